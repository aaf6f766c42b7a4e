"""Shard planning: pure arithmetic over sample counts and device throughputs."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Shard(NamedTuple):
    device: int | None  # position of the device in the input it was planned for; None when no device is known
    start: int
    stop: int


def plan_shards(n_samples: int, throughputs: Sequence[float], *, min_shard: int = 1) -> list[Shard]:
    """Split [0, n_samples) into contiguous shards sized in proportion to each device's throughput, so the
    devices finish together. Largest-remainder rounding keeps the sizes summing to n_samples exactly.

    No device known → one shard with everything, planned for nobody; one device → it gets everything.
    Devices that would get fewer than `min_shard` samples sit this round out (the slowest first) rather
    than get a shard too small to train on. Shards come back in the devices' input order.
    """
    if n_samples <= 0:
        raise ValueError("cannot shard an empty data set")
    if not throughputs:
        return [Shard(None, 0, n_samples)]
    speeds = [max(float(t), 0.0) or 1.0 for t in throughputs]  # unmeasured devices count as equals
    kept = sorted(range(len(speeds)), key=lambda i: (-speeds[i], i))
    kept_speed = sum(speeds)  # kept up to date as devices drop out: linear, not quadratic, in the devices
    while len(kept) > 1 and n_samples * speeds[kept[-1]] / kept_speed < min_shard:
        kept_speed -= speeds[kept.pop()]
    kept.sort()
    total = sum(speeds[i] for i in kept)
    exact = {i: n_samples * speeds[i] / total for i in kept}
    sizes = {i: int(exact[i]) for i in kept}
    for i in sorted(kept, key=lambda i: (sizes[i] - exact[i], i))[: n_samples - sum(sizes.values())]:
        sizes[i] += 1
    shards, start = [], 0
    for i in kept:
        shards.append(Shard(i, start, start + sizes[i]))
        start += sizes[i]
    return shards
