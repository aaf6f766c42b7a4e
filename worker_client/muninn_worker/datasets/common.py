"""What every dataset format shares: the customer-facing error, the parsed result, limits, small helpers."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DEFAULT_MAX_ROWS = 1_000_000
DEFAULT_MAX_FEATURES = 50_000  # a 128x128 RGB image is 49,152
DEFAULT_MAX_UNPACKED_BYTES = 2 * 1024**3  # a zip (.npz, images) may unpack to far more than the upload
MIN_ROWS = 10
PROFILE_FEATURE_NAMES = 50
SUPPORTED = ("CSV (UTF-8, with a header row), NumPy .npz (arrays X and y), a .zip of images in one folder per "
             "class, plain UTF-8 text (.txt), or transformer base weights (.safetensors)")
MISSING_TOKENS = frozenset({"", "na", "n/a", "nan", "null", "none", "?"})
ZIP_MAGIC, NPY_MAGIC = b"PK\x03\x04", b"\x93NUMPY"


class DatasetError(ValueError):
    """A problem with an uploaded dataset that the customer can fix.

    `code` is a stable slug for the API, `message` a sentence for the customer, `detail` a dict of
    JSON-safe facts (row, column, file, ...). Codes: unknown_format, pickle_rejected, bad_encoding, not_csv,
    ragged_row, missing_value, bad_number, bad_target, missing_array, bad_shape, no_rows, too_few_rows,
    too_few_classes, too_large, unsafe_path, bad_image, bad_weights.
    """

    def __init__(self, code: str, message: str, **detail):
        super().__init__(message)
        self.code = code
        self.message = message
        self.detail = detail


@dataclass(eq=False)
class ParsedDataset:
    """An upload as arrays, with its profile (plain JSON-safe types, shown to the customer).

    profile["kind"] says which arrays: "table" — X float32 [rows, features]; "image" — X float32
    [rows, features] flattened (.npz, shape in profile["image_shape"]) or [rows, channels, height, width]
    (a zip of images, decoded at the size asked for); "text" — X int64 [tokens], y None; "weights" — the
    tensors themselves in `tensors`, X and y None. y is int64 class indices (into `classes`) for
    classification, float32 targets for regression.
    """

    X: np.ndarray | None
    y: np.ndarray | None
    feature_names: list[str]
    classes: list[str]
    profile: dict
    tensors: dict = field(default_factory=dict)


def first_nonfinite(X: np.ndarray) -> tuple[int, int] | None:
    finite = np.isfinite(X)
    if finite.all():
        return None
    i = int(np.argmin(finite.all(axis=1)))
    return i, int(np.argmin(finite[i]))


def as_numbers(values: np.ndarray) -> np.ndarray | None:
    try:
        numbers = np.array([float(v) for v in values.tolist()], dtype=np.float64)
    except ValueError:
        return None
    return numbers if np.isfinite(numbers).all() else None


def decode_utf8(data: bytes, *, fix: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        row = data.count(b"\n", 0, exc.start) + 1
        hint = " It looks like UTF-16." if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise DatasetError("bad_encoding", f"row {row} is not valid UTF-8 text.{hint} {fix}", row=row,
                           byte=exc.start) from None


def check_rows(rows: int) -> None:
    if rows == 0:
        raise DatasetError("no_rows", "The dataset has no data rows.", rows=0)
    if rows < MIN_ROWS:
        raise DatasetError("too_few_rows", f"The dataset has {rows} rows; at least {MIN_ROWS} are needed to "
                           "train and hold some out for evaluation.", rows=rows, minimum=MIN_ROWS)
