"""Which format an upload is, judged by its first bytes and then its name; pickles are refused on sight."""
from __future__ import annotations

import io
import json
import os
import struct
import zipfile

import numpy as np

from .common import NPY_MAGIC, SUPPORTED, ZIP_MAGIC, DatasetError

PICKLE_EXTENSIONS = frozenset({".pkl", ".pickle", ".pt", ".pth", ".joblib", ".ckpt"})
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")
TEXT_EXTENSIONS = (".txt", ".text", ".md")


def sniff_format(filename: str, head: bytes) -> str:
    """Return "csv", "npz", "images", "text" or "weights" for an upload, by its first bytes, then its name."""
    name = os.path.basename(filename) or "the file"
    ext = os.path.splitext(name.lower())[1]
    if not head:
        raise DatasetError("no_rows", f"{name} is empty.", file=name)
    # Before the pickle check: a safetensors header of 640 bytes starts 0x80 0x02, like a pickle.
    if _looks_like_safetensors(head, trust_name=ext == ".safetensors"):
        return "weights"
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        raise pickle_error(name, "is a Python pickle")
    if ext in PICKLE_EXTENSIONS:
        raise pickle_error(name, f"is a {ext} file, which is a pickle")
    if head.startswith(NPY_MAGIC):
        if _npy_has_objects(head):
            raise pickle_error(name, "is a .npy array of Python objects, which only unpickling can load")
        raise DatasetError("unknown_format", f"{name} is a single .npy array, so it has no labels. Save "
                           "features and labels together: numpy.savez(file, X=features, y=labels).", file=name)
    if head.startswith(ZIP_MAGIC):
        return _sniff_zip(name, ext, head)
    if ext == ".safetensors":
        return "weights"  # the weights parser says what is wrong with it
    if ext in (".csv", ".tsv") or (ext == "" and b"\x00" not in head):
        return "csv"  # the parser reports encoding problems with their row
    if ext in TEXT_EXTENSIONS and b"\x00" not in head:
        return "text"
    why = {".txt": "is not plain text (it holds NUL bytes)",
           ".npz": "is named .npz but is not a NumPy .npz archive"}.get(ext, "is not a format Muninn reads")
    raise DatasetError("unknown_format", f"{name} {why}. Upload {SUPPORTED}.", file=name)


def _sniff_zip(name: str, ext: str, head: bytes) -> str:
    entries = [n for n in _zip_names(head) if not n.endswith("/")]
    lowered = [n.lower() for n in entries]
    pickled = [n for n, low in zip(entries, lowered) if low.endswith((".pkl", ".pickle"))]
    if pickled:
        raise pickle_error(name, f"holds a pickle ({pickled[0]}), as torch.save writes")
    if entries and all(low.endswith(".npy") for low in lowered):
        return "npz"
    if not entries and ext == ".npz":
        return "npz"  # the head was too short to list entries; parse_dataset looks at the whole file
    if any(low.startswith("xl/") for low in lowered):
        why = "is an Excel workbook; save it as 'CSV UTF-8' and upload that"
    elif any(low.endswith(IMAGE_EXTENSIONS) for low in lowered) or ext == ".zip":
        return "images"  # the image parser checks every entry (names, types, sizes) and says what is wrong
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


def pickle_error(name: str, what: str) -> DatasetError:
    return DatasetError("pickle_rejected", f"{name} {what}. Loading a pickle can run arbitrary code, so "
                        "Muninn never opens one. Save your arrays with numpy.savez(file, X=features, "
                        f"y=labels), or upload a CSV.", file=name)


def _looks_like_safetensors(head: bytes, *, trust_name: bool) -> bool:
    """An 8-byte little-endian header length, then a JSON object: safetensors' layout. A header longer than
    the head we were given counts only for a file named .safetensors (the weights parser checks it all)."""
    if len(head) < 10 or head[8:9] != b"{":
        return False
    (length,) = struct.unpack("<Q", head[:8])
    if length > 100 * 1024 * 1024:
        return False
    if length + 8 > len(head):
        return trust_name
    try:
        return isinstance(json.loads(head[8 : 8 + length]), dict)
    except ValueError:
        return False
