"""What this device can do: cores, memory, accelerators, and a measured training throughput.

The site routes units by these capabilities and sizes shards in proportion to `samples_per_s`, so the
throughput is measured (a short training run of the mlp template on random data), not looked up.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from muninn_worker.flops import flops_per_sample
from muninn_worker.zoo import build_model, get_template

__all__ = ["probe_device", "BENCHMARK_CONFIG", "BENCHMARK_BATCH"]

# Big enough that matmuls dominate python overhead, small enough to run anywhere in well under a second.
BENCHMARK_CONFIG = {"in_features": 64, "num_classes": 10, "hidden": [256, 256]}
BENCHMARK_BATCH = 64


def probe_device(quick: bool = True) -> dict:
    """Capabilities as the registration endpoint expects them. quick=True benchmarks ~0.25 s, else ~1 s."""
    samples_per_s = _benchmark_samples_per_s(seconds=0.25 if quick else 0.9)
    return {
        "cpu_cores": _cpu_cores(),
        "ram_bytes": _ram_bytes(),
        "backends": _backends(),
        "gpus": _gpus(),
        "torch_version": torch.__version__.split("+")[0],
        "samples_per_s": round(samples_per_s, 1),
        "flops_per_s": float(samples_per_s * flops_per_sample("mlp", BENCHMARK_CONFIG, BENCHMARK_BATCH)),
    }


def _cpu_cores() -> int:
    """Cores this process may use (respects CPU affinity / container limits where the OS reports them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0  # unknown (e.g. Windows without /proc); the site treats 0 as "not reported"


def _backends() -> list[str]:
    backends = ["cpu"]
    if torch.cuda.is_available():
        backends.append("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        backends.append("mps")
    return backends


def _gpus() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"name": props.name, "memory_bytes": int(props.total_memory)})
    return gpus


def _benchmark_samples_per_s(seconds: float) -> float:
    """Train the benchmark MLP on CPU (where the worker trains) for about `seconds`; samples per second."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model("mlp", BENCHMARK_CONFIG)
    inputs, targets = get_template("mlp").example_batch(BENCHMARK_CONFIG, BENCHMARK_BATCH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()

    deadline = time.perf_counter() + seconds  # the warm-up counts against the budget too
    step()  # warm-up: the first call pays for allocation and kernel selection
    steps = 0
    started = time.perf_counter()
    while True:  # at least one timed step, however slow the machine
        step()
        steps += 1
        if time.perf_counter() >= deadline:
            break
    return steps * BENCHMARK_BATCH / (time.perf_counter() - started)
