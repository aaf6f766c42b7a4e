"""Label-skewed (non-IID) partitions of a training split across devices, for simulations and benchmarks.

The site never partitions by label: a round's shards are contiguous slices of the training split, sized by the
devices' speeds (`sharding`), so its devices see whatever mix of labels the upload's row order gives them.
Real contributors' data is rarely that even; `dirichlet_split` models the usual alternative (Hsu et al. 2019):
per class, its samples are shared among the devices in Dirichlet(alpha) proportions. A small alpha (0.1) gives
most devices one or two classes; a large one (100) comes close to an even mix.
"""
from __future__ import annotations

import numpy as np

__all__ = ["dirichlet_split"]


def dirichlet_split(y: np.ndarray, devices: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Per class, share its samples among `devices` by Dirichlet(alpha) proportions. Returns each device's row
    indices into `y`, sorted (a device may get none); together they cover every row exactly once."""
    if devices < 1 or not alpha > 0:
        raise ValueError(f"need at least one device and alpha > 0 (got {devices} devices, alpha {alpha})")
    parts: list[list[int]] = [[] for _ in range(devices)]
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        cuts = (np.cumsum(rng.dirichlet([alpha] * devices)) * len(idx)).astype(int)[:-1]
        for d, chunk in enumerate(np.split(idx, cuts)):
            parts[d].extend(chunk.tolist())
    return [np.array(sorted(p), dtype=np.int64) for p in parts]
