"""The order in which a unit's training visits its shard: a function of (seed, epoch) alone.

Every runtime must draw the same batches for the same step (a CPU, a CUDA GPU, a validator re-training one
segment from its middle, a browser later), so the order never comes from torch's random streams, whose
CPU and CUDA generators differ. It is SplitMix64 (Steele, Lea & Flood 2014) driving a Fisher–Yates shuffle,
in plain 64-bit integer arithmetic that any language reproduces:

    state = (seed * 0x9E3779B97F4A7C15 + epoch + 1) mod 2^64
    next():  state = (state + 0x9E3779B97F4A7C15) mod 2^64
             z = state
             z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) mod 2^64
             z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) mod 2^64
             return z ^ (z >> 31)
    perm = [0, 1, ..., n-1]
    for i = n-1 down to 1:  j = next() mod (i + 1);  swap perm[i], perm[j]

(`mod (i + 1)` has a bias below n / 2^64: nothing any shard size can notice.) docs/worker-protocol.md
states the same algorithm; `tests` pin its first values.
"""

from __future__ import annotations

import math
from functools import lru_cache

__all__ = ["permutation", "batch_indices", "total_steps"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


@lru_cache(maxsize=8)
def permutation(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    """The shard's order in `epoch` (0-based) for this unit's `seed`."""
    state = (seed * _GOLDEN + epoch + 1) & _MASK
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        state = (state + _GOLDEN) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        j = (z ^ (z >> 31)) % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return tuple(perm)


def total_steps(samples: int, *, epochs: int, batch_size: int, inner_steps: int | None = None) -> int:
    """Optimizer steps of a unit: epochs × ceil(samples / batch), or exactly DiLoCo's `inner_steps`."""
    return inner_steps if inner_steps is not None else epochs * math.ceil(samples / batch_size)


def batch_indices(step: int, *, seed: int, samples: int, batch_size: int, inner_steps: int | None = None) -> list[int]:
    """The shard rows of optimizer step `step` (0-based).

    Epochs (FedAvg): step s is batch s mod ceil(n / b) of epoch s div ceil(n / b); an epoch's last batch may
    be short. Inner steps (DiLoCo): every step takes exactly min(b, n) rows, read in order from the
    back-to-back permutations of epochs 0, 1, 2, ..."""
    if inner_steps is None:
        per_epoch = math.ceil(samples / batch_size)
        epoch, position = divmod(step, per_epoch)
        return list(permutation(seed, epoch, samples)[position * batch_size:(position + 1) * batch_size])
    batch = min(batch_size, samples)
    rows, start = [], step * batch
    for at in range(start, start + batch):
        epoch, position = divmod(at, samples)
        rows.append(permutation(seed, epoch, samples)[position])
    return rows
