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


# How the tier line names where a job's units train (jobs.services.template_backends).
BACKEND_NAMES = {"cpu": "CPU", "cuda": "NVIDIA GPU (CUDA)", "mps": "Apple GPU (MPS)"}


def tier_line(tier: DeviceTier, backends: Sequence[str]) -> str:
    """The quote's device tier in words, naming the backend the job's units go to: "S — CPU: any device with
    2 GiB of memory free", "S — NVIDIA GPU (CUDA) only: a GPU with 2 GiB free"."""
    memory = f"{tier.memory_bytes // GIB} GiB"
    if tuple(backends) == ("cpu",):
        return f"{tier.name} — CPU: any device with {memory} of memory free"
    names = " or ".join(BACKEND_NAMES.get(b, b) for b in backends)
    return f"{tier.name} — {names} only: a GPU with {memory} free"


def no_device_warning(*, devices_online: int, devices_recent: int | None, tier: DeviceTier,
                      backends: Sequence[str], recent: str, wait_limit: str) -> str | None:
    """What the quote says before the customer pays when no device able to run the job has been seen for a while
    (`recent`, in words): its price would be held while it waits. None when one is online or was recently, or
    when nobody asked (devices_recent None)."""
    if devices_online or devices_recent is None or devices_recent > 0:
        return None
    need = tier_line(tier, backends).split(" — ", 1)[1]
    return (f"No device that can run this job ({need}) has been online in the last {recent}. If you start it, "
            f"its price is held while it waits for one; after {wait_limit} without one it fails and the hold is "
            "released.")


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
