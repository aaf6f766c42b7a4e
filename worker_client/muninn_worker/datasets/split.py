"""The held-out split: made once per job with the job's seed, stable across numpy versions."""
from __future__ import annotations

import numpy as np


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
    order = _permutation(np.random.PCG64(seed), n)
    return np.sort(order[n_test:]), np.sort(order[:n_test])


def training_order(n: int, *, seed: int) -> np.ndarray:
    """A permutation of 0..n-1 for the seed, from a stream of its own (PCG64's, jumped once, stable as above): the
    order a job keeps its training rows in. A round's shards are contiguous slices of that split, and an upload
    in its own order (an image folder's classes one after another, a CSV sorted by its label or by time) gave
    each device one or two classes, so FedAvg swung between them instead of converging."""
    return _permutation(np.random.PCG64(seed).jumped(), n)


def _permutation(generator: np.random.PCG64, n: int) -> np.ndarray:
    """0..n-1 ordered by the generator's raw stream, which numpy keeps stable across versions."""
    return np.argsort(generator.random_raw(n), kind="stable").astype(np.int64)
