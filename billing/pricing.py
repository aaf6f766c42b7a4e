"""What a quote promises besides its price: the device tier a job needs and the wall time it should take.
Pure functions over plain values, no Django."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class DeviceTier:
    name: str
    memory_bytes: int  # the most memory a job of this tier may need
    description: str


TIERS = (
    DeviceTier("S", 2 * GIB, "any CPU or GPU with 2 GiB free"),
    DeviceTier("M", 8 * GIB, "a device with 8 GiB (most laptops, small GPUs)"),
    DeviceTier("L", 24 * GIB, "a GPU with 24 GiB (RTX 3090/4090 class)"),
    DeviceTier("XL", 80 * GIB, "a data-centre GPU with 80 GiB"),
)


class TooBigForAnyTier(ValueError):
    pass


def device_tier(peak_memory_bytes: int) -> DeviceTier:
    """The smallest tier whose devices can hold the job's peak memory (weights, gradients, optimizer state and
    the activations of one batch)."""
    for tier in TIERS:
        if peak_memory_bytes <= tier.memory_bytes:
            return tier
    raise TooBigForAnyTier(f"the job needs {peak_memory_bytes / GIB:.1f} GiB; the largest tier has "
                           f"{TIERS[-1].memory_bytes // GIB} GiB")


def expected_wall_seconds(*, flops_per_round: int, rounds: int, device_flops_per_s: Sequence[float],
                          round_overhead_seconds: float) -> float | None:
    """Rounds × (the round's FLOPs over the devices' combined measured FLOP/s, since shards are sized ∝
    throughput so devices finish together) + a fixed per-round overhead (download, upload, aggregation).
    None when no capable device is online now: the job would wait for one."""
    total_speed = sum(s for s in device_flops_per_s if s > 0)
    if total_speed <= 0:
        return None
    return rounds * (flops_per_round / total_speed + round_overhead_seconds)
