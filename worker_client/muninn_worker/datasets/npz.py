"""NumPy .npz uploads: arrays X (rows x features, or a stack of images) and y, read with allow_pickle=False."""
from __future__ import annotations

import io
import zipfile

import numpy as np

from .common import PROFILE_FEATURE_NAMES, ZIP_MAGIC, DatasetError, ParsedDataset, check_rows, first_nonfinite
from .sniff import pickle_error
from .targets import encode_target


def parse_npz(data: bytes, *, target: str | None, task: str | None, max_rows: int, max_features: int,
              max_unpacked: int) -> ParsedDataset:
    label_key = target or "y"
    try:
        entries = zipfile.ZipFile(io.BytesIO(data)).infolist() if data.startswith(ZIP_MAGIC) else None
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        entries = None
    if entries is None:
        raise DatasetError("unknown_format", "This file is not a readable .npz archive. Save it with "
                           "numpy.savez(file, X=features, y=labels).")
    pickled = [e.filename for e in entries if e.filename.lower().endswith((".pkl", ".pickle"))]
    if pickled:
        raise pickle_error("The .npz", f"holds a pickle ({pickled[0]})")
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
        extra.update(image_layout(list(X.shape[1:])))
    width = int(np.prod(X.shape[1:]))
    if width == 0 or width > max_features:
        raise DatasetError("bad_shape" if width == 0 else "too_large", f"X has {width} features per row; "
                           f"between 1 and {max_features} are allowed.", features=width, limit=max_features)
    with np.errstate(over="ignore"):
        X32 = X.reshape(rows, width).astype(np.float32)
    bad = first_nonfinite(X32)
    if bad:
        i, j = bad
        raise DatasetError("bad_number", f"X row {i} holds {X.reshape(rows, width)[i, j]} at feature {j}; every "
                           "value must be a finite number (no NaN or infinity, within 32-bit float range).",
                           row=i, column=j)
    labels = _check_label_array(labels, label_key, rows)
    check_rows(rows)
    names = [f"x{j}" for j in range(width)]
    y, classes, target_profile = encode_target(labels, lambda i: f"{label_key}[{i}]", label_key, task)
    profile = {"format": "npz", "kind": "image" if X.ndim > 2 else "table", "rows": rows, "features": width,
               "feature_names": names[:PROFILE_FEATURE_NAMES], "target": label_key, **target_profile, **extra}
    return ParsedDataset(X=X32, y=y, feature_names=names, classes=classes, profile=profile)


def image_layout(shape: list[int]) -> dict:
    """How an .npz's images lie: [H, W] (grey), [H, W, C] (channels last, C in 1, 3, 4) or [C, H, W]."""
    if len(shape) == 2:
        return {"image_shape": [1, *shape], "channels_last": False}
    if shape[-1] in (1, 3, 4) and shape[0] not in (1, 3, 4):
        return {"image_shape": [shape[2], shape[0], shape[1]], "channels_last": True}
    return {"image_shape": list(shape), "channels_last": False}


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
