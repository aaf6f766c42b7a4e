"""muninn.lru.SizedLRU: the web's caches are bounded by bytes, the least recently used out first."""
from __future__ import annotations

import threading

from muninn.lru import SizedLRU


def test_the_least_recently_used_go_first_when_the_bytes_run_out():
    cache = SizedLRU(10)
    for key in "abcde":
        cache.put(key, key.upper(), 2)
    assert cache.keys() == list("abcde") and cache.bytes == 10
    assert cache.get("a") == "A"  # now the most recent
    cache.put("f", "F", 3)  # 13 bytes: b and c (the least recent) make room
    assert cache.keys() == ["d", "e", "a", "f"] and cache.bytes == 9
    assert cache.get("b") is None and "b" not in cache and len(cache) == 4


def test_a_value_over_the_largest_is_returned_but_never_kept():
    cache = SizedLRU(100, largest=10)
    cache.put("small", 1, 5)
    assert cache.put("big", 2, 11) == 2
    assert "big" not in cache and cache.keys() == ["small"] and cache.bytes == 5
    assert cache.put("whole", 3, 10) == 3 and cache.bytes == 15


def test_the_first_value_put_under_a_key_is_the_one_every_caller_gets():
    cache = SizedLRU(100)
    first = object()
    assert cache.put("k", first, 1) is first
    assert cache.put("k", object(), 1) is first  # another thread decoded it too: one copy is shared
    assert cache.bytes == 1


def test_threads_putting_at_once_leave_the_bytes_counted_exactly():
    cache = SizedLRU(1000)

    def fill(offset: int) -> None:
        for n in range(2000):
            cache.put((offset, n % 300), n, 7)
            cache.get((offset, (n * 7) % 300))

    threads = [threading.Thread(target=fill, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert cache.bytes == 7 * len(cache) <= 1000


def test_clear_empties_it():
    cache = SizedLRU(10)
    cache.put("a", 1, 4)
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0 and cache.get("a") is None
