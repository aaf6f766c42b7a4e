"""A cache bounded by the bytes it holds, the least recently used out first. The web keeps a few such per process
or per thread (blobs read again and again, a round's decoded weights, a job's check model): bounded by a count
instead, eight digits MLPs of 40 KB and eight resnet18s of 45 MB each took the same room, so the first were
dropped and rebuilt under bench/load.py's 40 jobs while the second could hold gigabytes."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SizedLRU(Generic[K, V]):
    """At most `max_bytes` of values, each as large as its `size` says; a value over `largest` (default
    `max_bytes`) is never kept, so that one large value cannot push out everything else. Thread-safe."""

    def __init__(self, max_bytes: int, *, largest: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.largest = max_bytes if largest is None else largest
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: K, value: V, size: int) -> V:
        """Keep `value` under `key` (unless it is over `largest`) and return the value the cache holds for `key`:
        one another thread put meanwhile wins, so that every caller shares a single copy."""
        if size > self.largest:
            return value
        with self._lock:
            kept = self._items.get(key)
            if kept is not None:
                self._items.move_to_end(key)
                return kept[0]
            self._items[key] = (value, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._bytes -= self._items.popitem(last=False)[1][1]
        return value

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    @property
    def bytes(self) -> int:
        return self._bytes

    def keys(self) -> list[K]:
        """The keys, the least recently used first."""
        with self._lock:
            return list(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
