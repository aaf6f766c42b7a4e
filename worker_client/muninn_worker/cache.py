"""A content-addressed download cache: files named by their sha256, so a hit is known to be right.

Rounds of a job re-use shards, and every unit of a round shares the same global weights; caching by hash
means each body crosses the network once. Writes go to a temporary file and are renamed into place, so a
killed client never leaves a half-written entry under a real hash.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__ = ["ContentCache", "HashMismatch"]

_HEX = set("0123456789abcdef")


class HashMismatch(ValueError):
    """Downloaded bytes do not hash to what the server promised."""


class ContentCache:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()

    def path_for(self, sha256: str) -> Path:
        sha256 = sha256.lower()
        if len(sha256) != 64 or not set(sha256) <= _HEX:
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / "sha256" / sha256[:2] / sha256

    def get(self, sha256: str) -> bytes | None:
        """The cached bytes, or None when absent or corrupt (a corrupt entry is deleted)."""
        path = self.path_for(sha256)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if hashlib.sha256(data).hexdigest() != sha256.lower():
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # mark as recently used for prune()
        return data

    def put(self, sha256: str, chunks: Iterable[bytes]) -> bytes:
        """Store the streamed chunks under `sha256` after checking they hash to it; return the bytes."""
        path = self.path_for(sha256)
        path.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        parts: list[bytes] = []
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as tmp:
                for chunk in chunks:
                    digest.update(chunk)
                    parts.append(chunk)
                    tmp.write(chunk)
            if digest.hexdigest() != sha256.lower():
                raise HashMismatch(f"downloaded bytes hash to {digest.hexdigest()}, expected {sha256.lower()}")
            os.replace(tmp_name, path)
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)
        return b"".join(parts)

    def prune(self, max_bytes: int) -> int:
        """Delete least recently used entries until the cache holds at most `max_bytes`; return bytes freed."""
        entries = [p for p in (self.root / "sha256").glob("*/*") if p.is_file() and not p.name.startswith(".")]
        stats = sorted(((p.stat().st_mtime, p.stat().st_size, p) for p in entries), key=lambda e: e[0])
        total = sum(size for _, size, _ in stats)
        freed = 0
        for _, size, path in stats:
            if total - freed <= max_bytes:
                break
            path.unlink(missing_ok=True)
            freed += size
        return freed
