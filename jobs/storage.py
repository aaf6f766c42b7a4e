"""Content-addressed blobs (weights, shards, uploads) on Django's default storage.

The path is the sha256 of the bytes, so a blob is written once, can be cached anywhere by its hash, and a
task that runs twice writes the same file.
"""
import contextlib
import hashlib
import io
import os
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from django.core.files.base import ContentFile
from django.core.files.storage import FileSystemStorage, default_storage
from django.utils._os import safe_makedirs

from muninn.failpoints import failpoint
from muninn.lru import SizedLRU

from . import sealing


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blob_path(sha256: str) -> str:
    return f"blobs/{sha256[:2]}/{sha256}"


def blob_put(data: bytes) -> str:
    sha = sha256_hex(data)
    _files_put_many({blob_path(sha): data}, threads=1)  # straight to a local disk: every result stores two
    return sha


def _file_put(path: str, data: bytes) -> None:
    """A content-addressed file, written once: one already there is left as it is."""
    if not default_storage.exists(path):
        default_storage.save(path, ContentFile(data))


def blobs_put(blobs: Sequence[bytes], *, threads: int = 8) -> list[str]:
    """Store many blobs at once (a round's shards); their hashes in order. The writes overlap in threads:
    each is mostly waiting on the file system (or an object store's round trip). Identical blobs are
    written once, so no two threads ever race for one path. On the local file system the files are written
    straight (see _files_put): Django's storage API costs ~150 µs a file, most of a 10,000-shard round."""
    shas = [sha256_hex(data) for data in blobs]
    _files_put_many({blob_path(sha): data for sha, data in zip(shas, blobs)}, threads=threads)
    return shas


def _files_put_many(files: dict[str, bytes], *, threads: int) -> None:
    """{path: bytes} written as blobs_put says: straight to the local file system, else through the storage API
    in threads (an object store's round trips overlap)."""
    if isinstance(default_storage, FileSystemStorage):
        _files_put(default_storage, files, threads=threads)
    elif len(files) <= 1 or threads <= 1:
        for path, data in files.items():
            _file_put(path, data)
    else:
        with ThreadPoolExecutor(max_workers=min(threads, len(files))) as pool:
            list(pool.map(lambda item: _file_put(*item), files.items()))


def _files_put(store: FileSystemStorage, blobs: dict[str, bytes], *, threads: int) -> None:
    """What FileSystemStorage.save does for a new content-addressed file (its folders, modes and group, a
    file created exclusively, so a blob already there is left as it is, unless it is short: _rewrite), without its
    per-file overhead. Each thread writes a contiguous share of the blobs ({path under the root: bytes}); the os
    calls release the GIL."""
    root = store.location
    for parent in {os.path.dirname(path) for path in blobs}:
        folder = os.path.join(root, parent)
        if store.directory_permissions_mode is None:
            os.makedirs(folder, exist_ok=True)
        else:
            safe_makedirs(folder, store.directory_permissions_mode, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    mode = store.file_permissions_mode
    group = os.stat(root).st_gid if os.name == "posix" else None

    def fill(fd: int, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if mode is not None:
                os.fchmod(fd, mode)
            if group is not None and os.fstat(fd).st_gid != group:
                try:
                    os.fchown(fd, -1, group)
                except PermissionError:
                    pass
        finally:
            os.close(fd)

    def write(items: list[tuple[str, bytes]]) -> None:
        for path, data in items:
            full = os.path.join(root, path)
            try:
                fd = os.open(full, flags, 0o666)
            except FileExistsError:
                if os.stat(full).st_size != len(data):
                    _rewrite(full, data, fill)
                continue
            failpoint("blob.created")
            fill(fd, data)

    items = list(blobs.items())
    if len(items) < 64 or threads <= 1:
        write(items)
        return
    share = -(-len(items) // threads)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(write, [items[i:i + share] for i in range(0, len(items), share)]))


def _rewrite(path: str, data: bytes, fill) -> None:
    """A blob's file found shorter than its bytes: what a writer killed between creating it and writing it whole
    leaves (the commit that would have named it never came, so nothing refers to it yet). Written again whole
    beside it, then put in its place in one rename: a reader sees the short file or the whole one, never a
    third. Before this, the next upload of the same bytes (the device sending its result again) found the file
    there and kept it, and its receipt then named a blob that was not its bytes."""
    temporary = f"{path}.{uuid.uuid4().hex}.partial"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        fill(fd, data)  # (closes it)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def blob_get(sha256: str) -> bytes:
    with default_storage.open(blob_path(sha256), "rb") as f:
        return f.read()


CACHE_BYTES = 64 * 2**20  # the most bytes blob_get_cached keeps in a process
_CACHE: SizedLRU[str, bytes] = SizedLRU(CACHE_BYTES, largest=CACHE_BYTES // 8)


def blob_get_cached(sha256: str) -> bytes:
    """blob_get for blobs read again and again (a round's global weights, read by every result's checks): a blob is
    named by its content, so a copy kept in memory is never stale. The least recently used go first."""
    data = _CACHE.get(sha256)
    if data is None:
        data = blob_get(sha256)
        data = _CACHE.put(sha256, data, len(data))
    return data


def blob_range_open(sha256: str, offset: int, size: int, *, expect: str) -> "CheckedRange":
    """`size` bytes of a blob from `offset` (a unit's shard in its round's pack) as a file read once, in order,
    whose bytes must hash to `expect`: a seek in a local file, one ranged GET on S3 (django-storages' S3 file
    would download the whole object before its first read)."""
    bucket = getattr(default_storage, "bucket", None)
    if bucket is not None and size > 0:
        from storages.utils import clean_name

        obj = bucket.Object(default_storage._normalize_name(clean_name(blob_path(sha256))))
        raw = obj.get(Range=f"bytes={offset}-{offset + size - 1}")["Body"]
    else:
        raw = blob_open(sha256)
        raw.seek(offset)
    return CheckedRange(raw, size, expect=expect, name=f"{sha256}[{offset}:{offset + size}]")


class BlobDamaged(Exception):
    """A stored blob is not what its name says (shorter, or other bytes): the store is damaged."""


class CheckedRange(io.RawIOBase):
    """A range of a stored file, read as it is sent (a download streams it, a 1-device round's shard is the whole
    training split), hashed as it goes: the read that would complete bytes which are not `expect` raises
    BlobDamaged instead (a streamed response is then cut short, which the device's client refuses), as does one
    that finds the file shorter than the range. Seeking only answers FileResponse's question of its size."""

    def __init__(self, raw, size: int, *, expect: str, name: str):
        super().__init__()
        self._raw, self._size, self._expect, self._label = raw, size, expect, name
        self._hash, self._done, self._pos = hashlib.sha256(), 0, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        target = {io.SEEK_SET: pos, io.SEEK_CUR: self._pos + pos, io.SEEK_END: self._size + pos}[whence]
        if self._done and target != self._done:
            raise io.UnsupportedOperation("a checked range is read once, in order")
        self._pos = target
        return target

    def readinto(self, buffer) -> int:
        if self._pos != self._done:
            raise io.UnsupportedOperation("a checked range is read from where its last read ended")
        want = min(len(buffer), self._size - self._done)
        if want <= 0:
            return 0
        chunk = self._raw.read(want)
        if not chunk:
            raise BlobDamaged(f"{self._label}: the file ends {self._size - self._done} bytes short of the range")
        self._hash.update(chunk)
        self._done = self._pos = self._done + len(chunk)
        if self._done == self._size and self._hash.hexdigest() != self._expect:
            raise BlobDamaged(f"{self._label}: its bytes are not {self._expect}")
        buffer[:len(chunk)] = chunk
        return len(chunk)

    def readall(self) -> bytes:  # the rest in one read of the file, not RawIOBase's 8 KiB at a time
        parts = []
        while chunk := self.read(max(self._size - self._done, 1)):
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


def blob_size(sha256: str) -> int:
    return default_storage.size(blob_path(sha256))


def blob_open(sha256: str):
    return default_storage.open(blob_path(sha256), "rb")


def blob_exists(sha256: str) -> bool:
    return default_storage.exists(blob_path(sha256))


# --- Sealed blobs: a sensitive dataset's data, encrypted at rest (jobs/sealing.py) -----------------------------
# Named by the plaintext's sha256 like any blob (the caller keeps that name), stored under a keyed name as
# ciphertext. `key` None: the dataset is not sensitive, and these are the plain functions above.

def sealed_path(sha256: str, key: bytes) -> str:
    name = sealing.sealed_name(key, sha256)
    return f"sealed/{name[:2]}/{name}"


def data_put(data: bytes, *, key: bytes | None) -> str:
    if key is None:
        return blob_put(data)
    sha = sha256_hex(data)
    path = sealed_path(sha, key)
    if not default_storage.exists(path):  # sealed only when it is not stored yet
        default_storage.save(path, ContentFile(sealing.seal(data, key, sha256=sha)))
    return sha


def data_put_many(blobs: Sequence[bytes], *, key: bytes | None, threads: int = 8) -> list[str]:
    """blobs_put, sealed under `key` when there is one (a round's shards of a sensitive dataset)."""
    if key is None:
        return blobs_put(blobs, threads=threads)
    shas = [sha256_hex(data) for data in blobs]
    unique = {sealed_path(sha, key): (sha, data) for sha, data in zip(shas, blobs)}
    _files_put_many({path: sealing.seal(data, key, sha256=sha) for path, (sha, data) in unique.items()},
                    threads=threads)
    return shas


def data_get(sha256: str, *, key: bytes | None) -> bytes:
    """The plaintext of a blob, sealed or not (sealing.SealError when a sealed one does not open)."""
    if key is None:
        return blob_get(sha256)
    with default_storage.open(sealed_path(sha256, key), "rb") as f:
        return sealing.unseal(f.read(), key, sha256=sha256)
