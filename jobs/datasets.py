"""Dataset intake: recognise an upload's format, parse it into arrays, and profile it.

Pure Python + numpy: no Django and no I/O beyond the bytes handed in, so the upload view, the tasks
that shard a job and the tests all read a dataset the same way. Every problem a customer can fix is
a DatasetError whose message says what is wrong, where, and how to fix it.
"""
from __future__ import annotations

import array
import csv
import io
import math
import os
import struct
import zipfile
from dataclasses import dataclass
from typing import Callable

import numpy as np

DEFAULT_MAX_ROWS = 1_000_000
DEFAULT_MAX_FEATURES = 50_000  # a 128x128 RGB image is 49,152
DEFAULT_MAX_UNPACKED_BYTES = 2 * 1024**3  # an .npz is a zip: its arrays may be far larger than the upload
MIN_ROWS = 10
PROFILE_FEATURE_NAMES = 50
SUPPORTED = "CSV (UTF-8, with a header row) or NumPy .npz (arrays X and y)"
MISSING_TOKENS = frozenset({"", "na", "n/a", "nan", "null", "none", "?"})
PICKLE_EXTENSIONS = frozenset({".pkl", ".pickle", ".pt", ".pth", ".joblib", ".ckpt"})
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")
ZIP_MAGIC, NPY_MAGIC = b"PK\x03\x04", b"\x93NUMPY"


class DatasetError(ValueError):
    """A problem with an uploaded dataset that the customer can fix.

    `code` is a stable slug for the API, `message` a sentence for the customer, `detail` a dict of
    JSON-safe facts (row, column, ...). Codes: unknown_format, pickle_rejected, bad_encoding, not_csv,
    ragged_row, missing_value, bad_number, bad_target, missing_array, bad_shape, no_rows,
    too_few_rows, too_few_classes, too_large.
    """

    def __init__(self, code: str, message: str, **detail):
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail


@dataclass(eq=False)
class ParsedDataset:
    X: np.ndarray  # float32 [rows, features]; images are flattened (shape in profile["input_shape"])
    y: np.ndarray  # int64 [rows], indexes into `classes`
    feature_names: list[str]
    classes: list[str]  # original labels as strings, numeric order when all are numbers
    profile: dict  # plain JSON-safe types, see parse_dataset


# ---------------------------------------------------------------------------- format sniffing

def sniff_format(filename: str, head: bytes) -> str:
    """Return "csv" or "npz" for an upload, judged by its first bytes and then its name."""
    name = os.path.basename(filename) or "the file"
    ext = os.path.splitext(name.lower())[1]
    if not head:
        raise DatasetError("no_rows", f"{name} is empty.", file=name)
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        raise _pickle_error(name, "is a Python pickle")
    if ext in PICKLE_EXTENSIONS:
        raise _pickle_error(name, f"is a {ext} file, which is a pickle")
    if head.startswith(NPY_MAGIC):
        if _npy_has_objects(head):
            raise _pickle_error(name, "is a .npy array of Python objects, which only unpickling can load")
        raise DatasetError("unknown_format", f"{name} is a single .npy array, so it has no labels. Save "
                           "features and labels together: numpy.savez(file, X=features, y=labels).", file=name)
    if head.startswith(ZIP_MAGIC):
        return _sniff_zip(name, ext, head)
    if ext in (".csv", ".tsv") or (ext == "" and b"\x00" not in head):
        return "csv"  # the parser reports encoding problems with their row
    why = {".txt": "is plain text; plain-text datasets are not supported yet (a table should be saved as .csv)",
           ".npz": "is named .npz but is not a NumPy .npz archive"}.get(ext, "is not a format Muninn reads")
    raise DatasetError("unknown_format", f"{name} {why}. Upload {SUPPORTED}.", file=name)


def _sniff_zip(name: str, ext: str, head: bytes) -> str:
    entries = [n for n in _zip_names(head) if not n.endswith("/")]
    lowered = [n.lower() for n in entries]
    pickled = [n for n, low in zip(entries, lowered) if low.endswith((".pkl", ".pickle"))]
    if pickled:
        raise _pickle_error(name, f"holds a pickle ({pickled[0]}), as torch.save writes")
    if entries and all(low.endswith(".npy") for low in lowered):
        return "npz"
    if not entries and ext == ".npz":
        return "npz"  # the head was too short to list entries; parse_dataset looks at the whole file
    if any(low.startswith("xl/") for low in lowered):
        why = "is an Excel workbook; save it as 'CSV UTF-8' and upload that"
    elif any(low.endswith(IMAGE_EXTENSIONS) for low in lowered):
        why = "is a zip of images; image-folder datasets are not supported yet"
    else:
        why = "is a zip archive Muninn doesn't recognise"
    raise DatasetError("unknown_format", f"{name} {why}. Upload {SUPPORTED}.", file=name)


def _zip_names(head: bytes) -> list[str]:
    try:  # works when the head is the whole file
        return zipfile.ZipFile(io.BytesIO(head)).namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        pass
    names, pos = [], 0  # otherwise walk the local file headers we have
    while head[pos:pos + 4] == ZIP_MAGIC and pos + 30 <= len(head):
        flags, = struct.unpack_from("<H", head, pos + 6)
        size, = struct.unpack_from("<I", head, pos + 18)
        name_len, extra_len = struct.unpack_from("<HH", head, pos + 26)
        raw = head[pos + 30:pos + 30 + name_len]
        if len(raw) < name_len:
            break
        names.append(raw.decode("utf-8", "replace"))
        if flags & 0x08 or size == 0xFFFFFFFF:  # size unknown here (streamed or zip64): stop
            break
        pos += 30 + name_len + extra_len + size
    return names


def _npy_has_objects(head: bytes) -> bool:
    try:
        stream = io.BytesIO(head)
        major, _ = np.lib.format.read_magic(stream)
        read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        return read(stream)[2].hasobject
    except Exception:  # truncated or odd header: fall back to spotting the object dtype code
        return b"|O" in head[:4096]


def _pickle_error(name: str, what: str) -> DatasetError:
    return DatasetError("pickle_rejected", f"{name} {what}. Loading a pickle can run arbitrary code, so "
                        "Muninn never opens one. Save your arrays with numpy.savez(file, X=features, "
                        f"y=labels), or upload a CSV.", file=name)


# ---------------------------------------------------------------------------- parsing

def parse_dataset(data: bytes, fmt: str, *, target: str | None = None, max_rows: int = DEFAULT_MAX_ROWS,
                  max_features: int = DEFAULT_MAX_FEATURES,
                  max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_BYTES) -> ParsedDataset:
    """Parse an upload in `fmt` ("csv" or "npz") into features, class indices and a profile.

    `target` names the label column (CSV; default the last column) or label array (NPZ; default "y").
    """
    if fmt == "csv":
        X, labels, names, label_name, where, extra = _parse_csv(data, target, max_rows, max_features)
    elif fmt == "npz":
        X, labels, names, label_name, where, extra = _parse_npz(
            data, target or "y", max_rows, max_features, max_unpacked_bytes)
    else:
        raise DatasetError("unknown_format", f"Unknown dataset format {fmt!r}; upload {SUPPORTED}.", format=fmt)
    rows = len(X)
    if rows == 0:
        raise DatasetError("no_rows", "The dataset has no data rows.", rows=0)
    if rows < MIN_ROWS:
        raise DatasetError("too_few_rows", f"The dataset has {rows} rows; at least {MIN_ROWS} are needed to "
                           "train and hold some out for evaluation.", rows=rows, minimum=MIN_ROWS)
    y, classes = _encode_labels(labels, where)
    if len(classes) < 2:
        raise DatasetError("too_few_classes", f"The labels in {label_name!r} have only one class "
                           f"({classes[0]!r}); a classifier needs at least 2.", target=label_name, classes=classes)
    counts = np.bincount(y, minlength=len(classes))
    profile = {"format": fmt, "rows": rows, "features": int(X.shape[1]),
               "feature_names": names[:PROFILE_FEATURE_NAMES], "target": label_name, "classes": classes,
               "num_classes": len(classes), "class_counts": dict(zip(classes, counts.tolist())),
               "task": "classification", **extra}
    return ParsedDataset(X=X, y=y, feature_names=names, classes=classes, profile=profile)


def _parse_csv(data: bytes, target: str | None, max_rows: int, max_features: int):
    text = _decode_utf8(data)
    first_line = io.StringIO(text).readline()
    delimiter = max(",;\t", key=first_line.count)  # ties (and none) go to the comma
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    values, labels, lines = array.array("d"), [], []
    try:
        header = [cell.strip() for cell in next(reader, [])]
        names, t = _check_header(header, target)
        features = [i for i in range(len(names)) if i != t]
        feature_names = [names[i] for i in features]
        if len(features) > max_features:
            raise DatasetError("too_large", f"The file has {len(features)} feature columns; the limit is "
                               f"{max_features}.", features=len(features), limit=max_features)
        for line, row in enumerate(reader, start=2):  # row numbers as a spreadsheet shows them
            if not any(cell.strip() for cell in row):
                continue  # blank line
            if len(row) != len(names):
                raise DatasetError("ragged_row", f"row {line} has {len(row)} fields but the header has "
                                   f"{len(names)}; every row needs one value per column.",
                                   row=line, fields=len(row), expected=len(names))
            if len(lines) == max_rows:
                raise DatasetError("too_large", f"The file has more than {max_rows} data rows, the limit.",
                                   limit=max_rows)
            cells = [row[i].strip() for i in features]
            values.extend(_row_values(cells, line, feature_names, decimal_comma=delimiter != ","))
            label = row[t].strip()
            if not label:
                raise DatasetError("missing_value", f"row {line}, column {names[t]!r}: the label is empty; "
                                   "every row needs a label.", row=line, column=names[t])
            labels.append(label)
            lines.append(line)
    except csv.Error as exc:
        raise DatasetError("not_csv", f"row {reader.line_num}: this is not valid CSV ({exc}).",
                           row=reader.line_num) from None
    with np.errstate(over="ignore"):
        X = np.frombuffer(values, dtype=np.float64).reshape(len(lines), len(features)).astype(np.float32)
    bad = _first_nonfinite(X)
    if bad:
        i, j = bad
        raise DatasetError("bad_number", f"row {lines[i]}, column {feature_names[j]!r}: the value is too "
                           "large for a 32-bit float.", row=lines[i], column=feature_names[j])
    return (X, np.array(labels, dtype=str), feature_names, names[t],
            lambda i: f"row {lines[i]}, column {names[t]!r}", {})


def _decode_utf8(data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        row = data.count(b"\n", 0, exc.start) + 1
        hint = " It looks like UTF-16." if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise DatasetError("bad_encoding", f"row {row} is not valid UTF-8 text.{hint} Save the file as UTF-8 "
                           "(in Excel: 'CSV UTF-8') and upload it again.", row=row, byte=exc.start) from None


def _check_header(header: list[str], target: str | None) -> tuple[list[str], int]:
    if len(header) < 2:
        raise DatasetError("not_csv", "row 1 (the header) has fewer than 2 columns; Muninn needs at least one "
                           "feature column and a label column, separated by commas, semicolons or tabs.", row=1)
    seen: dict[str, int] = {}
    for number, name in enumerate(header, start=1):
        if not name:
            raise DatasetError("not_csv", f"row 1, column {number}: the header cell is empty; every column "
                               "needs a name.", row=1, column=number)
        if name in seen:
            raise DatasetError("not_csv", f"row 1: the column name {name!r} appears twice (columns "
                               f"{seen[name]} and {number}); column names must be unique.", row=1, column=name)
        seen[name] = number
    if _as_numbers(np.array(header)) is not None:
        raise DatasetError("not_csv", "row 1 holds numbers, not column names; the first row must be a header "
                           "naming each column.", row=1)
    if target is None:
        return header, len(header) - 1
    if target not in seen:
        shown = ", ".join(repr(h) for h in header[:20]) + (", ..." if len(header) > 20 else "")
        raise DatasetError("bad_target", f"There is no column named {target!r}. The columns are: {shown}.",
                           target=target, columns=header[:100])
    return header, seen[target] - 1


def _row_values(cells: list[str], line: int, names: list[str], decimal_comma: bool) -> list[float]:
    if decimal_comma:  # "1,5" in a ;- or tab-separated file is one and a half
        cells = [c.replace(",", ".") if c.count(",") == 1 and "." not in c else c for c in cells]
    try:
        values = [float(c) for c in cells]
        if math.isfinite(sum(values)):
            return values
    except ValueError:
        pass
    for cell, name in zip(cells, names):  # slow path: find the first bad cell and say why
        _check_cell(cell, line, name)
    return [float(c) for c in cells]  # only huge finite values overflowed the sum


def _check_cell(cell: str, line: int, column: str) -> None:
    shown = repr(cell if len(cell) <= 40 else cell[:37] + "...")
    if cell.lower() in MISSING_TOKENS:
        what = "empty" if not cell else f"missing ({shown})"
        raise DatasetError("missing_value", f"row {line}, column {column!r}: the value is {what}. Fill in "
                           "every feature value or drop the row; missing values are not supported yet.",
                           row=line, column=column)
    try:
        number = float(cell)
    except ValueError:
        raise DatasetError("bad_number", f"row {line}, column {column!r}: {shown} is not a number. Features "
                           "must be numeric for now (categorical features come later); if this column holds "
                           "the labels, choose it as the target.", row=line, column=column, value=cell[:100]) from None
    if not math.isfinite(number):
        raise DatasetError("bad_number", f"row {line}, column {column!r}: {shown} is not a finite number.",
                           row=line, column=column, value=cell[:100])


def _parse_npz(data: bytes, label_key: str, max_rows: int, max_features: int, max_unpacked: int):
    try:
        entries = zipfile.ZipFile(io.BytesIO(data)).infolist() if data.startswith(ZIP_MAGIC) else None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        entries = None
    if entries is None:
        raise DatasetError("unknown_format", "This file is not a readable .npz archive. Save it with "
                           "numpy.savez(file, X=features, y=labels).")
    pickled = [e.filename for e in entries if e.filename.lower().endswith((".pkl", ".pickle"))]
    if pickled:
        raise _pickle_error("The .npz", f"holds a pickle ({pickled[0]})")
    unpacked = sum(e.file_size for e in entries)
    if unpacked > max_unpacked:
        raise DatasetError("too_large", f"The .npz unpacks to {unpacked} bytes; the limit is {max_unpacked}.",
                           unpacked_bytes=unpacked, limit=max_unpacked)
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:  # zip magic checked: an NpzFile
        arrays = list(archive.files)
        missing = [key for key in ("X", label_key) if key not in arrays]
        if missing:
            raise DatasetError("missing_array", f"The .npz has no array named {' or '.join(map(repr, missing))} "
                               f"(it holds {', '.join(map(repr, arrays)) or 'nothing'}). Save the features as "
                               "X and the labels as y: numpy.savez(file, X=features, y=labels).",
                               missing=missing, arrays=arrays)
        X, labels = _load_array(archive, "X"), _load_array(archive, label_key)
    if X.dtype.kind not in "biuf":
        raise DatasetError("bad_number", f"X has dtype {X.dtype}; it must hold numbers.", dtype=str(X.dtype))
    if X.ndim not in (2, 3, 4):
        raise DatasetError("bad_shape", f"X has shape {list(X.shape)}; it must be rows x features (2-D) or a "
                           "stack of images (3-D or 4-D).", shape=list(X.shape))
    rows, extra = X.shape[0], {}
    if rows > max_rows:
        raise DatasetError("too_large", f"X has {rows} rows; the limit is {max_rows}.", rows=rows, limit=max_rows)
    if X.ndim > 2:
        extra["input_shape"] = list(X.shape[1:])
    width = int(np.prod(X.shape[1:]))
    if width == 0 or width > max_features:
        raise DatasetError("bad_shape" if width == 0 else "too_large", f"X has {width} features per row; "
                           f"between 1 and {max_features} are allowed.", features=width, limit=max_features)
    with np.errstate(over="ignore"):
        X32 = X.reshape(rows, width).astype(np.float32)
    bad = _first_nonfinite(X32)
    if bad:
        i, j = bad
        raise DatasetError("bad_number", f"X row {i} holds {X.reshape(rows, width)[i, j]} at feature {j}; every "
                           "value must be a finite number (no NaN or infinity, within 32-bit float range).",
                           row=i, column=j)
    labels = _check_label_array(labels, label_key, rows)
    names = [f"x{j}" for j in range(width)]
    return X32, labels, names, label_key, lambda i: f"{label_key}[{i}]", extra


def _load_array(archive, key: str) -> np.ndarray:
    try:
        return archive[key]
    except Exception as exc:  # a damaged entry fails in many ways: zlib, CRC, header, dtype
        if isinstance(exc, ValueError) and "pickle" in str(exc).lower():
            raise DatasetError("pickle_rejected", f"Array {key!r} in the .npz holds Python objects, which only "
                               "unpickling can load (and unpickling can run code). Save it as a plain number "
                               "or string array.", array=key) from None
        raise DatasetError("unknown_format", f"Array {key!r} in the .npz could not be read ({exc}).",
                           array=key) from None


def _check_label_array(labels: np.ndarray, key: str, rows: int) -> np.ndarray:
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1:
        raise DatasetError("bad_target", f"{key!r} has shape {list(labels.shape)}; it must hold one label per "
                           f"row (1-D). For one-hot labels save {key}.argmax(axis=1).", shape=list(labels.shape))
    if len(labels) != rows:
        raise DatasetError("bad_shape", f"X has {rows} rows but {key!r} has {len(labels)} labels; they must "
                           "match.", rows=rows, labels=len(labels))
    if labels.dtype.kind not in "biufUS":
        raise DatasetError("bad_target", f"{key!r} has dtype {labels.dtype}; labels must be integers or strings.",
                           dtype=str(labels.dtype))
    if labels.dtype.kind == "f" and not np.isfinite(labels).all():
        i = int(np.argmin(np.isfinite(labels)))
        raise DatasetError("missing_value", f"{key}[{i}] is {labels[i]}; every row needs a label.", row=i)
    if labels.dtype.kind == "S":
        labels = np.char.decode(labels, "utf-8", "replace")
    if labels.dtype.kind == "U" and (labels == "").any():
        i = int(np.argmax(labels == ""))
        raise DatasetError("missing_value", f"{key}[{i}] is an empty label; every row needs a label.", row=i)
    return labels


# ---------------------------------------------------------------------------- labels, checks, split

def _encode_labels(labels: np.ndarray, where: Callable[[int], str]) -> tuple[np.ndarray, list[str]]:
    uniq, y = np.unique(labels, return_inverse=True)
    y = y.reshape(-1).astype(np.int64)
    numbers = uniq.astype(np.float64) if labels.dtype.kind in "biuf" else _as_numbers(uniq)
    if numbers is None:
        return y, [str(u) for u in uniq.tolist()]
    fractional = np.flatnonzero(numbers != np.floor(numbers))
    if len(fractional):
        k = int(fractional[0])
        raise DatasetError("bad_target", f"{where(int(np.argmax(y == k)))}: the label {str(uniq[k])!r} is not a "
                           "whole number. Muninn trains classifiers for now (regression comes later), so the "
                           "target must hold class labels.", value=str(uniq[k]))
    kind_f = labels.dtype.kind == "f"  # 1.0 -> "1"
    classes = [str(int(v)) if kind_f else str(v) for v in (numbers if kind_f else uniq).tolist()]
    order = np.lexsort((np.arange(len(numbers)), numbers))  # numeric order: 2 before 10
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[y].astype(np.int64), [classes[k] for k in order]


def _as_numbers(values: np.ndarray) -> np.ndarray | None:
    try:
        numbers = np.array([float(v) for v in values.tolist()], dtype=np.float64)
    except ValueError:
        return None
    return numbers if np.isfinite(numbers).all() else None


def _first_nonfinite(X: np.ndarray) -> tuple[int, int] | None:
    finite = np.isfinite(X)
    if finite.all():
        return None
    i = int(np.argmin(finite.all(axis=1)))
    return i, int(np.argmin(finite[i]))


def split_holdout(n: int, *, test_fraction: float = 0.2, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split row indices 0..n-1 into (train, test), each sorted; the same n and seed give the same split.

    At least one row lands on each side. The order comes from PCG64's raw stream, which numpy keeps
    stable across versions (Generator.permutation is not promised to be), so a job's holdout stays put.
    """
    if n < 2:
        raise ValueError(f"need at least 2 rows to hold some out, got {n}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be between 0 and 1, got {test_fraction}")
    n_test = min(n - 1, max(1, round(n * test_fraction)))
    order = np.argsort(np.random.PCG64(seed).random_raw(n), kind="stable")
    return np.sort(order[n_test:]).astype(np.int64), np.sort(order[:n_test]).astype(np.int64)
