"""The formats beyond numeric tables: categorical CSV columns, regression targets, zips of class-folder images,
plain text for language models, safetensors base weights."""
import io
import zipfile

import numpy as np
import pytest
from muninn_worker import tensors, zoo
from muninn_worker.samples import generated_text, synthetic_images
from PIL import Image
from sklearn.datasets import load_diabetes

from muninn_worker.datasets import DatasetError, parse_dataset, sniff_format, windows
from muninn_worker.datasets.images import parse_images


def error_of(call, *args, **kwargs) -> DatasetError:
    with pytest.raises(DatasetError) as caught:
        call(*args, **kwargs)
    return caught.value


def image_zip(images=None, labels=None, *, root="", fmt="PNG", extra=()) -> bytes:
    if images is None:
        images, labels = synthetic_images(per_class=6, size=12)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for i, (image, label) in enumerate(zip(images, labels)):
            raw = io.BytesIO()
            Image.fromarray(image).save(raw, format=fmt)
            archive.writestr(f"{root}{['bars', 'columns', 'boxes'][label]}/{i}.{fmt.lower()}", raw.getvalue())
        for name, data in extra:
            archive.writestr(name, data)
    return buffer.getvalue()


# ---------------------------------------------------------------------------- CSV: categories, regression

def test_categorical_columns_are_one_hot_encoded_over_a_stored_sorted_vocabulary():
    colours = ["red", "green", "blue", "", "green"] * 4
    lines = ["size,colour,label"] + [f"{i},{c},{'yes' if i % 3 else 'no'}" for i, c in enumerate(colours)]
    data = ("\n".join(lines) + "\n").encode()

    parsed = parse_dataset(data, "csv")
    again = parse_dataset(data, "csv")

    column = parsed.profile["columns"][1]
    assert column == {"name": "colour", "type": "categorical", "categories": ["(missing)", "blue", "green", "red"]}
    assert parsed.feature_names == ["size", "colour=(missing)", "colour=blue", "colour=green", "colour=red"]
    assert parsed.X[0].tolist() == [0, 0, 0, 0, 1] and parsed.X[3].tolist() == [3, 1, 0, 0, 0]
    assert parsed.profile["missing"]["colour"] == {"count": 4, "rows": [5, 10, 15, 20], "filled_with": "(missing)"}
    np.testing.assert_array_equal(parsed.X, again.X)  # the same encoding at every read


def test_diabetes_whole_number_target_with_many_values_is_detected_as_regression():
    diabetes = load_diabetes()
    header = ",".join([*diabetes.feature_names, "progression"])
    rows = [",".join([*map(repr, x), str(int(t))]) for x, t in zip(diabetes.data.tolist(), diabetes.target)]
    data = ("\n".join([header, *rows]) + "\n").encode()

    parsed = parse_dataset(data, "csv")
    forced = parse_dataset(data, "csv", task="classification")

    assert parsed.profile["task"] == "regression" and parsed.y.dtype == np.float32
    np.testing.assert_allclose(parsed.y, diabetes.target)
    assert forced.profile["task"] == "classification" and forced.profile["num_classes"] > 30


# ---------------------------------------------------------------------------- image zips

def test_image_zip_is_decoded_resized_and_profiled_by_class_folder():
    data = image_zip(root="shapes/")

    parsed = parse_dataset(data, sniff_format("shapes.zip", data[:4096]), image_size=16)

    assert sniff_format("shapes.zip", data[:4096]) == "images"
    assert parsed.X.shape == (18, 3, 16, 16) and parsed.X.dtype == np.float32 and parsed.X.max() <= 255
    assert parsed.classes == ["bars", "boxes", "columns"]
    assert parsed.profile["class_counts"] == {"bars": 6, "boxes": 6, "columns": 6}
    assert parsed.profile["image_shape"] == [3, 16, 16] and parsed.profile["original_size"]["max"] == [12, 12]
    assert parsed.profile["kind"] == "image" and parsed.profile["resizable"] is True


def test_grey_jpegs_give_one_channel():
    images, labels = synthetic_images(per_class=5, size=10)
    grey = [np.asarray(Image.fromarray(i).convert("L")) for i in images]

    parsed = parse_dataset(image_zip(grey, labels, fmt="JPEG"), "images", image_size=8)

    assert parsed.X.shape == (15, 1, 8, 8)


@pytest.mark.parametrize("name", ["../evil.png", "/etc/cron.d/x.png", "cats/../../x.png", "C:/x.png",
                                  "cats\\..\\x.png"])
def test_image_zip_entries_that_point_outside_their_folder_are_refused(name):
    error = error_of(parse_dataset, image_zip(extra=[(name, b"x")]), "images")

    assert error.code == "unsafe_path" and "outside" in error.message


def test_image_zip_limits_files_size_and_pixels_naming_the_file():
    data = image_zip()
    big = io.BytesIO()
    Image.new("L", (300, 300)).save(big, format="PNG")

    assert error_of(parse_dataset, data, "images", max_unpacked_bytes=500).code == "too_large"
    assert error_of(parse_images, data, max_files=5).code == "too_large"
    pixels = error_of(parse_images, image_zip(extra=[("bars/huge.png", big.getvalue())]), max_pixels=200 * 200)
    assert pixels.code == "too_large" and pixels.detail["file"] == "bars/huge.png"


def test_image_zip_refuses_non_images_files_outside_class_folders_and_one_class():
    images, labels = synthetic_images(per_class=12, size=8)

    assert error_of(parse_dataset, image_zip(extra=[("bars/notes.txt", b"hi")]), "images").code == "bad_image"
    assert error_of(parse_dataset, image_zip(extra=[("loose.png", b"x")]), "images").code == "bad_shape"
    assert error_of(parse_dataset, image_zip(extra=[("bars/fake.png", b"not a png")]), "images").code == "bad_image"
    one_class = image_zip(images[:12], np.zeros(12, dtype=int))
    assert error_of(parse_dataset, one_class, "images").code == "too_few_classes"


# ---------------------------------------------------------------------------- text and weights

def test_text_is_tokenised_by_character_with_its_vocabulary_or_by_byte():
    text = generated_text(sentences=20) + "été\n"
    data = text.encode("utf-8")

    chars = parse_dataset(data, sniff_format("story.txt", data[:4096]), tokenizer="char")
    raw = parse_dataset(data, "text", tokenizer="byte")

    assert sniff_format("story.txt", data[:4096]) == "text"
    assert chars.profile["vocab"] == sorted(set(text)) and chars.profile["vocab_size"] == len(set(text))
    assert "".join(chars.profile["vocab"][i] for i in chars.X[:10]) == text[:10]
    assert raw.profile["vocab_size"] == 256 and raw.X.dtype == np.int64 and len(raw.X) == len(data)
    X, y = windows(chars.X, 16)
    assert X.shape == y.shape == ((len(text) - 1) // 16, 16) and (X[0, 1:] == y[0, :-1]).all()


def test_text_errors_are_clear():
    assert error_of(parse_dataset, b"too short", "text").code == "too_few_rows"
    assert error_of(parse_dataset, "é".encode("latin-1") * 300, "text").code == "bad_encoding"
    assert error_of(parse_dataset, b"x" * 300, "text", tokenizer="word").code == "bad_target"


def test_transformer_weights_are_profiled_and_anything_else_is_refused():
    config = {"vocab_size": 30, "context": 16, "d_model": 32, "layers": 2, "heads": 2}
    data = tensors.state_dict_to_bytes(zoo.init_state("transformer", config, 0),
                                       metadata={"muninn_model_config": '{"heads": 2}'})

    parsed = parse_dataset(data, sniff_format("base.safetensors", data[:4096]))

    assert sniff_format("base.safetensors", data[:4096]) == "weights"
    assert parsed.profile["model_config"] == config and parsed.profile["kind"] == "weights"
    other = tensors.state_dict_to_bytes(zoo.init_state("mlp", {"in_features": 3, "num_classes": 2, "hidden": []}, 0))
    assert error_of(parse_dataset, other, "weights").code == "bad_weights"
    assert error_of(parse_dataset, b"\x80\x04pickle", "weights").code == "bad_weights"


def test_safetensors_whose_header_length_looks_like_a_pickle_is_still_weights():
    import torch

    sized = (tensors.state_dict_to_bytes({"w": torch.zeros(2)}, metadata={"pad": "x" * n}) for n in range(700))
    data = next(d for d in sized if int.from_bytes(d[:8], "little") == 640)  # stored as 0x80 0x02 ...

    assert data[:2] == b"\x80\x02"
    assert sniff_format("adapters.safetensors", data[:4096]) == "weights"
    assert error_of(parse_dataset, data, "weights").code == "bad_weights"  # read, then found not a transformer


def test_images_that_would_decode_past_the_limit_are_refused_before_decoding(monkeypatch):
    from muninn_worker.datasets import images

    monkeypatch.setattr(images, "MAX_DECODED_ELEMENTS", 18 * 3 * 16 * 16 - 1)

    error = error_of(parse_dataset, image_zip(), "images", image_size=16)

    assert error.code == "too_large" and "image_size" in error.message
