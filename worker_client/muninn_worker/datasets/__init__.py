"""Dataset intake: recognise an upload's format, parse it into arrays, and profile it.

Pure Python + numpy (+ Pillow for images): no Django and no I/O beyond the bytes handed in, so the upload
view, the service that prepares a job and the tests all read a dataset the same way. Every problem a
customer can fix is a DatasetError whose message says what is wrong, where, and how to fix it.

Formats: "csv" (csv_tables), "npz" (npz), "images" (a zip of class folders, images), "text" (text),
"weights" (LoRA base weights, weights). Each has a parser, and a profile the UI shows.
"""
from __future__ import annotations

from .common import (
    DEFAULT_MAX_FEATURES, DEFAULT_MAX_ROWS, DEFAULT_MAX_UNPACKED_BYTES, MIN_ROWS, SUPPORTED, DatasetError,
    ParsedDataset,
)
from .csv_tables import parse_csv
from .images import parse_images
from .npz import parse_npz
from .sniff import sniff_format
from .split import split_holdout, training_order
from .text import parse_text, window_count, windows
from .weights import parse_weights

__all__ = ["DatasetError", "ParsedDataset", "sniff_format", "parse_dataset", "split_holdout", "training_order",
           "windows", "window_count", "MIN_ROWS", "FORMATS"]

FORMATS = ("csv", "npz", "images", "text", "weights")


def parse_dataset(data: bytes, fmt: str, *, target: str | None = None, task: str | None = None,
                  tokenizer: str | None = None, image_size: int | None = None, max_rows: int = DEFAULT_MAX_ROWS,
                  max_features: int = DEFAULT_MAX_FEATURES,
                  max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_BYTES) -> ParsedDataset:
    """Parse an upload in `fmt` into arrays and a profile.

    `target` names the label column (CSV; default the last column) or label array (NPZ; default "y");
    `task` forces "classification" or "regression" (default: detected); `tokenizer` is "char" or "byte"
    (text); `image_size` is the side images of a zip are resized to (default 32).
    """
    if fmt == "csv":
        return parse_csv(data, target=target, task=task, max_rows=max_rows, max_features=max_features)
    if fmt == "npz":
        return parse_npz(data, target=target, task=task, max_rows=max_rows, max_features=max_features,
                         max_unpacked=max_unpacked_bytes)
    if fmt == "images":
        return parse_images(data, image_size=image_size, max_unpacked=min(max_unpacked_bytes, 512 * 1024**2))
    if fmt == "text":
        return parse_text(data, tokenizer=tokenizer)
    if fmt == "weights":
        return parse_weights(data)
    raise DatasetError("unknown_format", f"Unknown dataset format {fmt!r}; upload {SUPPORTED}.", format=fmt)
