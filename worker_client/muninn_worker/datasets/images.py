"""A zip of images, one folder per class (PNG or JPEG), decoded in memory and resized to the template's input.

Nothing is ever extracted to disk: each entry is read (at most its declared size, and never past the total
limit) into memory and decoded by Pillow. Entry names are checked before anything is read: absolute paths,
drive letters, backslashes and `..` are refused, so a hostile archive cannot even name a file outside its
folder. The image count, the total unpacked size and each image's pixel count are limited, the last
checked from the image header before any pixel is decoded.
"""
from __future__ import annotations

import io
import posixpath
import zipfile

import numpy as np
from PIL import Image, UnidentifiedImageError

from .common import PROFILE_FEATURE_NAMES, ZIP_MAGIC, DatasetError, ParsedDataset, check_rows

MAX_FILES = 20_000
MAX_UNPACKED_BYTES = 512 * 1024**2
MAX_PIXELS = 4096 * 4096
MAX_DECODED_ELEMENTS = 2**28  # the resized images as float32: 1 GiB
DEFAULT_SIZE = 32
FORMATS = {"PNG", "JPEG"}
EXTENSIONS = (".png", ".jpg", ".jpeg")
GREY_MODES = {"1", "L", "LA", "I", "I;16", "F"}


def parse_images(data: bytes, *, image_size: int | None = None, max_files: int = MAX_FILES,
                 max_unpacked: int = MAX_UNPACKED_BYTES, max_pixels: int = MAX_PIXELS) -> ParsedDataset:
    size = image_size or DEFAULT_SIZE
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        raise DatasetError("unknown_format", "This file is not a readable .zip archive.") from None
    entries = _entries(infos, max_files, max_unpacked)
    class_names = sorted({label for label, _ in entries})
    if len(class_names) < 2:
        raise DatasetError("too_few_classes", "The zip needs one folder per class and at least 2 classes (e.g. "
                           f"cats/1.png, dogs/1.png); it has {len(class_names)}: {class_names}.",
                           classes=class_names)
    index = {name: k for k, name in enumerate(class_names)}
    # Two passes, so that only one full-size image is ever decoded at a time: headers first (sizes, modes:
    # grey or colour decides the channels), then each image decoded and shrunk straight away.
    modes, sizes, unpacked = [], [], 0
    for _, info in entries:
        raw = _read(archive, info, max_unpacked - unpacked)
        unpacked += len(raw)
        header = _open(raw, info.filename, max_pixels)
        modes.append(header.mode)
        sizes.append(header.size)
    check_rows(len(entries))
    grey = all(mode in GREY_MODES for mode in modes)
    channels = 1 if grey else 3
    decoded = len(entries) * channels * size * size
    if decoded > MAX_DECODED_ELEMENTS:
        limit_gib = MAX_DECODED_ELEMENTS * 4 / 2**30
        raise DatasetError("too_large", f"{len(entries)} images of {channels}x{size}x{size} would take "
                           f"{decoded * 4 / 2**30:.1f} GiB decoded; the limit is {limit_gib:.2f} GiB. Choose a "
                           "smaller image_size or upload fewer images.", images=len(entries), size=size)
    X = np.empty((len(entries), channels, size, size), dtype=np.float32)
    for row, (_, info) in enumerate(entries):
        X[row] = _pixels(_decode(_read(archive, info, info.file_size), info.filename, max_pixels), size, grey)
    y = np.array([index[label] for label, _ in entries], dtype=np.int64)
    counts = np.bincount(y, minlength=len(class_names))
    widths, heights = [w for w, _ in sizes], [h for _, h in sizes]
    names = [f"c{c}_y{i}_x{j}" for c in range(channels) for i in range(size) for j in range(size)]
    profile = {
        "format": "images", "kind": "image", "task": "classification", "rows": len(entries),
        "features": channels * size * size, "feature_names": names[:PROFILE_FEATURE_NAMES], "target": "folder",
        "classes": class_names, "num_classes": len(class_names),
        "class_counts": dict(zip(class_names, counts.tolist())),
        "image_shape": [channels, size, size], "resizable": True,
        "original_size": {"min": [min(widths), min(heights)], "max": [max(widths), max(heights)]},
        "unpacked_bytes": unpacked,
    }
    return ParsedDataset(X=X, y=y, feature_names=names, classes=class_names, profile=profile)


def _entries(infos: list[zipfile.ZipInfo], max_files: int, max_unpacked: int) -> list[tuple[str, zipfile.ZipInfo]]:
    entries, declared = [], 0
    for info in infos:
        name = info.filename
        _check_name(name)
        if info.is_dir() or _ignored(name):
            continue
        parts = name.split("/")
        if len(parts) < 2:
            raise DatasetError("bad_shape", f"{name} is not in a class folder; put each image in a folder named "
                               "after its class (cats/1.png).", file=name)
        if not name.lower().endswith(EXTENSIONS):
            raise DatasetError("bad_image", f"{name} is not a PNG or JPEG image; the zip may hold only images.",
                               file=name)
        entries.append((parts, info))
        declared += info.file_size
        if len(entries) > max_files:
            raise DatasetError("too_large", f"The zip holds more than {max_files} images, the limit.", limit=max_files)
        if declared > max_unpacked:
            raise DatasetError("too_large", f"The zip unpacks to more than {max_unpacked} bytes, the limit.",
                               limit=max_unpacked)
    if not entries:
        raise DatasetError("no_rows", "The zip holds no PNG or JPEG images.", rows=0)
    # One folder around all the class folders (photos/cats/1.png) is the usual way a zip is made: skip it.
    depth = 2 if all(len(p) >= 3 for p, _ in entries) and len({p[0] for p, _ in entries}) == 1 else 1
    return [(parts[depth - 1], info) for parts, info in entries]


def _check_name(name: str) -> None:
    if (name.startswith("/") or "\\" in name or (len(name) > 1 and name[1] == ":")
            or ".." in name.split("/") or posixpath.normpath(name).startswith("..") or "\x00" in name):
        raise DatasetError("unsafe_path", f"The zip entry {name!r} points outside its folder; Muninn refuses "
                           "archives with absolute paths or '..' in their names.", file=name[:200])


def _ignored(name: str) -> bool:
    return name.startswith("__MACOSX/") or any(part.startswith(".") for part in name.split("/"))


def _read(archive: zipfile.ZipFile, info: zipfile.ZipInfo, budget: int) -> bytes:
    """The entry's bytes, never more than it declared nor than the remaining budget (a lying header or a
    zip bomb stops here, not in memory)."""
    limit = min(info.file_size, budget)
    try:
        with archive.open(info) as entry:
            raw = entry.read(limit + 1)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as exc:
        raise DatasetError("bad_image", f"{info.filename} could not be read from the zip ({exc}).",
                           file=info.filename) from None
    if len(raw) > limit:
        raise DatasetError("too_large", f"{info.filename} unpacks to more than its declared size or the zip's "
                           "limit.", file=info.filename)
    return raw


def _open(raw: bytes, name: str, max_pixels: int) -> Image.Image:
    """The image with only its header read: format and pixel count checked before any pixel is decoded."""
    try:
        image = Image.open(io.BytesIO(raw))
        if image.format not in FORMATS:
            raise DatasetError("bad_image", f"{name} is a {image.format} image; only PNG and JPEG are read.",
                               file=name)
        width, height = image.size
        if width * height > max_pixels:
            raise DatasetError("too_large", f"{name} is {width}x{height} pixels; the limit is {max_pixels} pixels "
                               "per image.", file=name, width=width, height=height, limit=max_pixels)
    except DatasetError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DatasetError("bad_image", f"{name} is not a readable PNG or JPEG image ({exc}).", file=name) from None
    return image


def _decode(raw: bytes, name: str, max_pixels: int) -> Image.Image:
    image = _open(raw, name, max_pixels)
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DatasetError("bad_image", f"{name} is not a readable PNG or JPEG image ({exc}).", file=name) from None
    return image


def _pixels(image: Image.Image, size: int, grey: bool) -> np.ndarray:
    """float32 [channels, size, size] in 0..255."""
    converted = image.convert("L" if grey else "RGB").resize((size, size), Image.Resampling.BILINEAR)
    array = np.asarray(converted, dtype=np.float32)
    return array[None] if grey else array.transpose(2, 0, 1)


def decode_for_model(data: bytes, name: str, *, size: int, grey: bool, max_files: int = 1000,
                     max_unpacked: int = 64 * 1024**2, max_pixels: int = MAX_PIXELS) -> tuple[np.ndarray, list[str]]:
    """New images as the training zip's were decoded: one PNG/JPEG, or a zip of them (folders allowed, any
    names), each converted to the training's channels and resized to its side. (X float32 [n, channels,
    size, size] in 0..255, the images' names.) The same checks as an upload: names, counts, sizes."""
    if not data.startswith(ZIP_MAGIC):
        return _pixels(_decode(data, name, max_pixels), size, grey)[None], [name]
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        raise DatasetError("unknown_format", f"{name} is not a readable .zip archive.", file=name) from None
    entries, declared = [], 0
    for info in infos:
        _check_name(info.filename)
        if info.is_dir() or _ignored(info.filename):
            continue
        if not info.filename.lower().endswith(EXTENSIONS):
            raise DatasetError("bad_image", f"{info.filename} is not a PNG or JPEG image; the zip may hold only "
                               "images.", file=info.filename)
        entries.append(info)
        declared += info.file_size
        if len(entries) > max_files or declared > max_unpacked:
            raise DatasetError("too_large", f"The zip holds more than {max_files} images or {max_unpacked} bytes "
                               "unpacked, the limits for one request.", limit=max_files)
    if not entries:
        raise DatasetError("no_rows", "The zip holds no PNG or JPEG images.", rows=0)
    X = np.empty((len(entries), 1 if grey else 3, size, size), dtype=np.float32)
    for row, info in enumerate(entries):
        X[row] = _pixels(_decode(_read(archive, info, info.file_size), info.filename, max_pixels), size, grey)
    return X, [info.filename for info in entries]
