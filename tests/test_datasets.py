"""Dataset intake: format sniffing, CSV/NPZ parsing, customer-facing errors, profiles, holdout split."""
import io
import json
import pickle
import zipfile

import numpy as np
import pytest
from sklearn.datasets import load_digits, load_iris

from muninn_worker.datasets import DatasetError, parse_dataset, sniff_format, split_holdout, training_order


# ---------------------------------------------------------------------------- helpers

def csv_bytes(header, rows, delimiter=","):
    lines = [delimiter.join(header)] + [delimiter.join(str(v) for v in row) for row in rows]
    return ("\n".join(lines) + "\n").encode("utf-8")


def npz_bytes(**arrays):
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def two_class_rows(n=10):
    """n rows of (a, b, label) with labels alternating 'cat'/'dog'."""
    return [[i, i * 0.5, "cat" if i % 2 else "dog"] for i in range(n)]


def iris_csv():
    iris = load_iris()
    header = ["sepal_length", "sepal_width", "petal_length", "petal_width", "species"]
    rows = [[*map(repr, features), iris.target_names[label]] for features, label in zip(iris.data.tolist(), iris.target)]
    return csv_bytes(header, rows), iris


def error_of(call, *args, **kwargs) -> DatasetError:
    with pytest.raises(DatasetError) as caught:
        call(*args, **kwargs)
    return caught.value


# ---------------------------------------------------------------------------- happy paths

def test_iris_csv_parses_with_exact_profile():
    data, iris = iris_csv()

    parsed = parse_dataset(data, "csv")

    assert parsed.X.dtype == np.float32 and parsed.X.shape == (150, 4)
    assert parsed.y.dtype == np.int64 and parsed.y.shape == (150,)
    np.testing.assert_allclose(parsed.X, iris.data.astype(np.float32))
    assert parsed.classes == ["setosa", "versicolor", "virginica"]
    np.testing.assert_array_equal(parsed.y, iris.target)
    assert parsed.feature_names == ["sepal_length", "sepal_width", "petal_length", "petal_width"]
    assert parsed.profile == {
        "format": "csv", "rows": 150, "features": 4,
        "feature_names": ["sepal_length", "sepal_width", "petal_length", "petal_width"],
        "target": "species", "classes": ["setosa", "versicolor", "virginica"], "num_classes": 3,
        "class_counts": {"setosa": 50, "versicolor": 50, "virginica": 50}, "task": "classification",
        "kind": "table", "missing": {},
        "columns": [{"name": n, "type": "numeric"} for n in ["sepal_length", "sepal_width", "petal_length",
                                                             "petal_width"]],
    }
    json.dumps(parsed.profile)  # plain types only


def test_named_target_column_is_used_and_left_out_of_features():
    rows = [["cat" if i % 2 else "dog", i, i + 1] for i in range(10)]

    parsed = parse_dataset(csv_bytes(["animal", "a", "b"], rows), "csv", target="animal")

    assert parsed.feature_names == ["a", "b"]
    assert parsed.classes == ["cat", "dog"]
    assert parsed.X[3].tolist() == [3.0, 4.0]
    assert parsed.y[3] == 0 and parsed.y[4] == 1


def test_numeric_labels_sort_numerically_not_as_text():
    labels = [10, 2, 1, 2, 10, 1, 1, 2, 10, 10]
    rows = [[i, label] for i, label in enumerate(labels)]

    parsed = parse_dataset(csv_bytes(["a", "label"], rows), "csv")

    assert parsed.classes == ["1", "2", "10"]
    assert parsed.y.tolist() == [2, 1, 0, 1, 2, 0, 0, 1, 2, 2]
    assert parsed.profile["class_counts"] == {"1": 3, "2": 3, "10": 4}


def test_utf8_bom_is_accepted():
    data = b"\xef\xbb\xbf" + csv_bytes(["a", "b", "label"], two_class_rows())

    parsed = parse_dataset(data, "csv")

    assert parsed.feature_names == ["a", "b"]
    assert parsed.profile["rows"] == 10


def test_semicolon_delimiter_with_decimal_commas_is_accepted():
    rows = [[f"{i},5", i, "cat" if i % 2 else "dog"] for i in range(10)]

    parsed = parse_dataset(csv_bytes(["a", "b", "label"], rows, delimiter=";"), "csv")

    assert parsed.feature_names == ["a", "b"]
    assert parsed.X[3].tolist() == [3.5, 3.0]


def test_excel_export_with_crlf_and_trailing_empty_rows_is_accepted():
    data = csv_bytes(["a", "b", "label"], two_class_rows()).replace(b"\n", b"\r\n") + b",,\r\n,,\r\n"

    parsed = parse_dataset(b"\xef\xbb\xbf" + data, "csv")

    assert parsed.profile["rows"] == 10 and parsed.classes == ["cat", "dog"]


def test_tab_delimiter_is_accepted():
    parsed = parse_dataset(csv_bytes(["a", "b", "label"], two_class_rows(), delimiter="\t"), "csv")

    assert parsed.X.shape == (10, 2)


def test_blank_lines_are_skipped_and_row_numbers_still_match_the_file():
    rows = two_class_rows()
    data = csv_bytes(["a", "b", "label"], rows[:5]) + b"\n" + csv_bytes(["a", "b", "label"], rows[5:]).split(b"\n", 1)[1]
    data = data.replace(b"7,3.5,cat", b"7,oops,cat")  # the 8th data row sits on file row 10 after the blank

    error = error_of(parse_dataset, data, "csv")

    assert error.detail["row"] == 10


def test_digits_npz_with_images_is_flattened_and_records_input_shape():
    digits = load_digits()
    data = npz_bytes(X=digits.images, y=digits.target)

    parsed = parse_dataset(data, "npz")

    assert parsed.X.shape == (1797, 64) and parsed.X.dtype == np.float32
    np.testing.assert_array_equal(parsed.X, digits.data.astype(np.float32))
    assert parsed.classes == [str(d) for d in range(10)]
    assert parsed.profile["input_shape"] == [8, 8]
    assert parsed.profile["rows"] == 1797 and parsed.profile["features"] == 64
    assert parsed.profile["num_classes"] == 10
    assert parsed.profile["class_counts"] == {str(d): int(c) for d, c in enumerate(np.bincount(digits.target))}
    assert parsed.profile["feature_names"] == [f"x{j}" for j in range(50)]
    assert len(parsed.feature_names) == 64
    json.dumps(parsed.profile)


def test_npz_with_string_labels_and_flat_features():
    iris = load_iris()
    data = npz_bytes(X=iris.data, y=iris.target_names[iris.target])

    parsed = parse_dataset(data, "npz")

    assert parsed.classes == ["setosa", "versicolor", "virginica"]
    np.testing.assert_array_equal(parsed.y, iris.target)
    assert "input_shape" not in parsed.profile


def test_npz_float_labels_that_are_whole_numbers_become_integer_classes():
    data = npz_bytes(X=np.arange(20.0).reshape(10, 2), y=np.array([0.0, 1.0] * 5))

    assert parse_dataset(data, "npz").classes == ["0", "1"]


# ---------------------------------------------------------------------------- format sniffing

def test_sniff_recognises_csv_and_npz():
    assert sniff_format("iris.csv", b"a,b,label\n1,2,x\n") == "csv"
    assert sniff_format("data.npz", npz_bytes(X=np.zeros((2, 2)), y=np.zeros(2))) == "npz"


def test_sniff_recognises_npz_from_a_short_head():
    data = npz_bytes(X=np.zeros((1000, 20)), y=np.zeros(1000))

    assert sniff_format("upload.npz", data[:512]) == "npz"


def test_pickle_posing_as_npz_is_rejected():
    error = error_of(sniff_format, "data.npz", pickle.dumps({"X": [1, 2]}))

    assert error.code == "pickle_rejected"
    assert "data.npz" in error.message and "pickle" in error.message


def test_pickle_posing_as_csv_is_rejected():
    assert error_of(sniff_format, "iris.csv", pickle.dumps([1, 2, 3])).code == "pickle_rejected"


def test_torch_save_file_is_rejected():
    torch = pytest.importorskip("torch")
    buffer = io.BytesIO()
    torch.save({"weights": torch.zeros(3)}, buffer)

    error = error_of(sniff_format, "model.npz", buffer.getvalue())

    assert error.code == "pickle_rejected"
    assert "data.pkl" in error.message


def test_npy_object_array_is_rejected():
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}, None], dtype=object))

    assert error_of(sniff_format, "x.npy", buffer.getvalue()).code == "pickle_rejected"


def test_npz_holding_an_object_array_is_rejected_when_parsed():
    data = npz_bytes(X=np.array([[1, "a"]] * 10, dtype=object), y=np.arange(10) % 2)

    error = error_of(parse_dataset, data, "npz")

    assert error.code == "pickle_rejected"
    assert "'X'" in error.message


def test_npz_holding_a_pickle_entry_is_rejected_when_parsed():
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps({"x": 1}))

    assert error_of(parse_dataset, buffer.getvalue(), "npz").code == "pickle_rejected"


@pytest.mark.parametrize("filename, head, words", [
    ("picture.png", b"\x89PNG\r\n\x1a\n\x00\x00", "CSV"),
    ("notes.txt", b"Once upon\x00 a time\n", "not plain text"),
    ("fake.npz", b"a,b\n1,2\n", "not a NumPy .npz archive"),
    ("sheet.xlsx", None, "Excel"),
])
def test_unsupported_files_name_the_supported_formats(filename, head, words):
    if head is None:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            archive.writestr("xl/workbook.xml" if filename.endswith("xlsx") else "cats/1.png", b"x")
        head = buffer.getvalue()

    error = error_of(sniff_format, filename, head)

    assert error.code == "unknown_format"
    assert words in error.message and filename in error.message


# ---------------------------------------------------------------------------- CSV errors

def test_non_numeric_feature_names_row_column_and_value():
    data, _ = iris_csv()
    lines = data.split(b"\n")
    cells = lines[16].split(b",")  # file row 17
    lines[16] = b",".join([*cells[:3], b"abc", cells[4]])
    data = b"\n".join(lines)

    error = error_of(parse_dataset, data, "csv")

    assert error.code == "bad_number"
    assert error.message.startswith("row 17, column 'petal_width': 'abc' is not a number, but most of")
    assert "categorical" in error.message
    assert error.detail == {"row": 17, "column": "petal_width", "value": "abc"}


@pytest.mark.parametrize("cell", ["", "NA", "?"])
def test_missing_numeric_value_is_filled_with_the_median_and_reported_with_its_row(cell):
    rows = two_class_rows()
    rows[4][1] = cell  # file row 6

    parsed = parse_dataset(csv_bytes(["a", "b", "label"], rows), "csv")

    median = float(np.median([r[1] for i, r in enumerate(two_class_rows()) if i != 4]))
    assert parsed.X[4, 1] == median
    assert parsed.profile["missing"] == {"b": {"count": 1, "rows": [6], "filled_with": median}}


def test_a_mostly_empty_column_is_refused_with_its_first_empty_row():
    rows = two_class_rows()
    for i in range(1, 7):
        rows[i][1] = ""

    error = error_of(parse_dataset, csv_bytes(["a", "b", "label"], rows), "csv")

    assert error.code == "missing_value" and error.detail["row"] == 3 and "6 of 10 rows" in error.message


def test_missing_label_names_row_and_target_column():
    rows = two_class_rows()
    rows[2][2] = ""

    error = error_of(parse_dataset, csv_bytes(["a", "b", "label"], rows), "csv")

    assert (error.code, error.detail) == ("missing_value", {"row": 4, "column": "label"})


def test_infinite_feature_is_a_bad_number():
    rows = two_class_rows()
    rows[0][0] = "inf"

    error = error_of(parse_dataset, csv_bytes(["a", "b", "label"], rows), "csv")

    assert error.code == "bad_number" and error.message.startswith("row 2, column 'a': 'inf' is not a finite")


def test_ragged_row_names_the_row():
    rows = two_class_rows()
    rows[6].append(99)  # file row 8

    error = error_of(parse_dataset, csv_bytes(["a", "b", "label"], rows), "csv")

    assert error.code == "ragged_row"
    assert error.message.startswith("row 8 has 4 fields but the header has 3")
    assert error.detail["row"] == 8


def test_unknown_target_lists_the_columns():
    error = error_of(parse_dataset, csv_bytes(["a", "b", "label"], two_class_rows()), "csv", target="species")

    assert error.code == "bad_target"
    assert "'species'" in error.message and "'a', 'b', 'label'" in error.message


def test_continuous_target_is_regression():
    rows = [[i, i * 0.37] for i in range(10)]

    parsed = parse_dataset(csv_bytes(["a", "price"], rows), "csv")

    assert parsed.profile["task"] == "regression" and "classes" not in parsed.profile
    assert parsed.y.dtype == np.float32 and parsed.y[3] == np.float32(1.11)
    assert parsed.profile["target_stats"]["max"] == pytest.approx(3.33)


def test_continuous_target_forced_to_classification_names_the_row():
    rows = [[i, i * 0.37] for i in range(10)]

    error = error_of(parse_dataset, csv_bytes(["a", "price"], rows), "csv", task="classification")

    assert error.code == "bad_target"
    assert error.message.startswith("row 3, column 'price': the label '0.37' is not a whole number")


def test_header_only_file_has_no_rows():
    assert error_of(parse_dataset, b"a,b,label\n", "csv").code == "no_rows"


def test_fewer_than_ten_rows_is_refused():
    error = error_of(parse_dataset, csv_bytes(["a", "b", "label"], two_class_rows(9)), "csv")

    assert error.code == "too_few_rows" and "9 rows" in error.message


def test_single_class_is_refused():
    rows = [[i, i, "cat"] for i in range(10)]

    error = error_of(parse_dataset, csv_bytes(["a", "b", "label"], rows), "csv")

    assert error.code == "too_few_classes"
    assert "'label'" in error.message and "'cat'" in error.message


@pytest.mark.parametrize("data, words", [
    (b"just_one_column\n1\n", "fewer than 2 columns"),
    (b"1,2,3\n4,5,6\n", "not column names"),
    (b"a,,label\n1,2,x\n", "column 2: the header cell is empty"),
    (b"a,a,label\n1,2,x\n", "'a' appears twice"),
    (b"", "fewer than 2 columns"),
])
def test_bad_header_is_not_csv(data, words):
    error = error_of(parse_dataset, data, "csv")

    assert error.code == "not_csv" and words in error.message


def test_non_utf8_file_names_the_row():
    data = csv_bytes(["name", "b", "label"], [["x", i, i % 2] for i in range(10)])
    data = data.replace(b"x,4,0", "é,4,0".encode("latin-1"))  # file row 6

    error = error_of(parse_dataset, data, "csv")

    assert error.code == "bad_encoding"
    assert error.message.startswith("row 6 is not valid UTF-8") and "CSV UTF-8" in error.message


def test_row_and_feature_limits_are_enforced():
    data = csv_bytes(["a", "b", "label"], two_class_rows(20))

    too_many_rows = error_of(parse_dataset, data, "csv", max_rows=15)
    too_many_features = error_of(parse_dataset, data, "csv", max_features=1)

    assert too_many_rows.code == "too_large" and "15" in too_many_rows.message
    assert too_many_features.code == "too_large" and too_many_features.detail["features"] == 2


def test_unknown_format_name_is_refused():
    assert error_of(parse_dataset, b"whatever", "parquet").code == "unknown_format"


# ---------------------------------------------------------------------------- NPZ errors

def test_npz_without_y_says_which_arrays_it_has():
    error = error_of(parse_dataset, npz_bytes(X=np.zeros((10, 2)), labels=np.zeros(10)), "npz")

    assert error.code == "missing_array"
    assert "'y'" in error.message and "'labels'" in error.message


def test_npz_nan_in_x_names_the_first_bad_row():
    X = np.arange(40.0).reshape(20, 2)
    X[7, 1] = np.nan
    X[12, 0] = np.inf

    error = error_of(parse_dataset, npz_bytes(X=X, y=np.arange(20) % 2), "npz")

    assert error.code == "bad_number"
    assert error.message.startswith("X row 7 holds nan at feature 1")
    assert error.detail == {"row": 7, "column": 1}


def test_npz_label_count_must_match_rows():
    error = error_of(parse_dataset, npz_bytes(X=np.zeros((10, 2)), y=np.arange(9) % 2), "npz")

    assert error.code == "bad_shape" and "10 rows" in error.message and "9 labels" in error.message


def test_npz_one_hot_labels_are_refused_with_a_fix():
    error = error_of(parse_dataset, npz_bytes(X=np.zeros((10, 2)), y=np.eye(10)), "npz")

    assert error.code == "bad_target" and "argmax" in error.message


def test_npz_that_is_not_a_zip_is_refused():
    assert error_of(parse_dataset, b"not a zip at all", "npz").code == "unknown_format"


def test_npz_limits_are_enforced():
    data = npz_bytes(X=np.zeros((20, 8, 8)), y=np.arange(20) % 2)

    assert error_of(parse_dataset, data, "npz", max_rows=10).code == "too_large"
    assert error_of(parse_dataset, data, "npz", max_features=63).code == "too_large"
    assert error_of(parse_dataset, data, "npz", max_unpacked_bytes=1000).code == "too_large"


def test_dataset_error_is_a_value_error_with_code_message_and_detail():
    error = error_of(parse_dataset, b"a,b\n", "csv", target="nope")

    assert isinstance(error, ValueError)
    assert str(error) == error.message
    assert error.detail["target"] == "nope"


# ---------------------------------------------------------------------------- holdout split

def test_split_is_deterministic_for_a_seed_and_differs_across_seeds():
    train_a, test_a = split_holdout(100, seed=7)
    train_b, test_b = split_holdout(100, seed=7)
    _, test_c = split_holdout(100, seed=8)

    np.testing.assert_array_equal(train_a, train_b)
    np.testing.assert_array_equal(test_a, test_b)
    assert not np.array_equal(test_a, test_c)


def test_split_partitions_all_rows_with_the_requested_fraction():
    train, test = split_holdout(100, test_fraction=0.25, seed=1)

    assert len(test) == 25 and len(train) == 75
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(100))


def test_split_holds_out_at_least_one_row_and_keeps_one_for_training():
    train, test = split_holdout(2, test_fraction=0.01, seed=0)

    assert len(test) == 1 and len(train) == 1
    assert len(split_holdout(3, test_fraction=0.99, seed=0)[0]) == 1


def test_split_is_pinned_so_a_jobs_holdout_never_moves_across_numpy_versions():
    train, test = split_holdout(10, seed=42)

    assert test.tolist() == [4, 8]
    assert train.tolist() == [0, 1, 2, 3, 5, 6, 7, 9]


def test_training_order_is_a_pinned_permutation_of_its_own():
    order = training_order(10, seed=42)

    assert order.tolist() == [4, 3, 9, 2, 8, 1, 5, 0, 6, 7]  # never moves across numpy versions
    assert sorted(training_order(1000, seed=7).tolist()) == list(range(1000))
    assert not np.array_equal(training_order(1000, seed=7), training_order(1000, seed=8))
