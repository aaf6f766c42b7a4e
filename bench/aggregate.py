"""FedAvg throughput: Muninn's `fedavg` against Flower's `aggregate` and a memory-bandwidth bound.

Averages K client updates of an N-parameter fp32 model (a transformer-shaped set of tensors: an embedding,
a few big matrices per layer, small biases and norms), on the same input each time:

  muninn fedavg          muninn_worker.federated.aggregation.fedavg on the torch state dicts
  flwr aggregate         flwr.server.strategy.aggregate.aggregate on the same memory as numpy arrays
  torch copy (bound)     dst.copy_(src) of the same K x N x 4 bytes, torch's default threads
  torch sum (read only)  reading the same bytes once: the floor for any average

Each is timed best-of-repeats, taking turns, from cold caches, after one untimed warm-up; GB/s is input
bytes (K x N x 4) / time. The copy reads and writes every byte while an average mostly reads, so an
average can beat the copy's "bound" but not the read-only floor.

    .venv/bin/python bench/aggregate.py [--clients 10] [--params 50000000] [--repeats 5]

The last line printed is one JSON object with the figures. flwr is a benchmark-only dependency:
`make bench-deps` installs it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from muninn_worker.federated.aggregation import fedavg  # noqa: E402

_SCRUB_BYTES = 512 << 20  # more than any last-level cache this runs on (260 MiB on the dev VM)


def main() -> int:
    options = _parse_args()
    try:
        from flwr.server.strategy.aggregate import aggregate as flwr_aggregate
    except ImportError as error:
        print(f"flwr is not installed ({error}). Install it with `make bench-deps`.", file=sys.stderr)
        return 2

    shapes = _model_shapes(options.params)
    params = sum(math.prod(shape) for _, shape in shapes)
    clients = options.clients
    input_bytes = clients * params * 4
    print(
        f"FedAvg of {clients} clients x {params:,} fp32 params ({len(shapes)} tensors, "
        f"{input_bytes / 1e9:.2f} GB of input), {torch.get_num_threads()} torch threads, "
        f"best of {options.repeats}",
        flush=True,
    )
    flats, states, samples = _client_updates(shapes, clients)

    flwr_input = [([tensor.numpy() for tensor in state.values()], count) for state, count in zip(states, samples)]
    destination = torch.empty(clients, params)

    def copy_all() -> None:
        for row, flat in zip(destination, flats):
            row.copy_(flat)

    best, outputs = _race(
        {
            "ours": lambda: fedavg(states, samples),
            "flwr": lambda: flwr_aggregate(flwr_input),
            "bound": copy_all,
            "read": lambda: [flat.sum() for flat in flats],
        },
        options.repeats,
    )
    max_abs_diff = max(
        float((ours_tensor - torch.from_numpy(flwr_array)).abs().max())
        for ours_tensor, flwr_array in zip(outputs["ours"].values(), outputs["flwr"])
    )
    _report(best, input_bytes, max_abs_diff, clients=clients, params=params, tensors=len(shapes), options=options)
    return 0


def _report(
    best: dict[str, float],
    input_bytes: int,
    max_abs_diff: float,
    *,
    clients: int,
    params: int,
    tensors: int,
    options: argparse.Namespace,
) -> None:
    """The table for people, then the figures as one JSON line for scripts."""
    rate = {name: input_bytes / seconds / 1e9 for name, seconds in best.items()}
    print(f"{'':22}{'time':>10}{'GB/s':>9}{'of bound':>10}")
    for label, name in (
        ("muninn fedavg", "ours"),
        ("flwr aggregate", "flwr"),
        ("torch copy (bound)", "bound"),
        ("torch sum (read only)", "read"),
    ):
        print(f"{label:22}{best[name] * 1e3:>8.1f} ms{rate[name]:>9.2f}{rate[name] / rate['bound']:>10.0%}")
    print(f"muninn is {best['flwr'] / best['ours']:.1f}x flwr; max |muninn - flwr| = {max_abs_diff:.2e}")
    figures = {
        "gbps": round(rate["ours"], 3),
        "bound_gbps": round(rate["bound"], 3),
        "flwr_gbps": round(rate["flwr"], 3),
        "read_gbps": round(rate["read"], 3),
        "vs_bound": round(rate["ours"] / rate["bound"], 3),
        "vs_flwr": round(best["flwr"] / best["ours"], 2),
        "seconds": round(best["ours"], 4),
        "bound_seconds": round(best["bound"], 4),
        "flwr_seconds": round(best["flwr"], 4),
        "read_seconds": round(best["read"], 4),
        "max_abs_diff": max_abs_diff,
        "clients": clients,
        "params": params,
        "tensors": tensors,
        "repeats": options.repeats,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(figures))


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=10, help="client updates to average (default 10)")
    parser.add_argument("--params", type=int, default=50_000_000, help="parameters per model (default 50M)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each; the best counts (default 5)")
    options = parser.parse_args()
    for name in ("clients", "params", "repeats"):
        if getattr(options, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return options


def _model_shapes(params: int, layers: int = 6) -> list[tuple[str, tuple[int, ...]]]:
    """A GPT-like layout of about `params` parameters: ~60% in the layers, the rest in the embedding."""
    width = max(8, int(math.sqrt(0.6 * params / (12 * layers))) // 8 * 8)
    layer = [
        ("attn.qkv.weight", (3 * width, width)),
        ("attn.qkv.bias", (3 * width,)),
        ("attn.out.weight", (width, width)),
        ("attn.out.bias", (width,)),
        ("ln1.weight", (width,)),
        ("ln1.bias", (width,)),
        ("mlp.up.weight", (4 * width, width)),
        ("mlp.up.bias", (4 * width,)),
        ("mlp.down.weight", (width, 4 * width)),
        ("mlp.down.bias", (width,)),
        ("ln2.weight", (width,)),
        ("ln2.bias", (width,)),
    ]
    body = layers * sum(math.prod(shape) for _, shape in layer) + 2 * width
    vocab = max(1, (params - body) // width)
    return [
        ("embed.weight", (vocab, width)),
        *((f"layers.{index}.{name}", shape) for index in range(layers) for name, shape in layer),
        ("ln_f.weight", (width,)),
        ("ln_f.bias", (width,)),
    ]


def _client_updates(
    shapes: list[tuple[str, tuple[int, ...]]], clients: int
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], list[int]]:
    """Per client: one flat random fp32 buffer, the state dict viewing it, and a sample count."""
    generator = torch.Generator().manual_seed(0)
    params = sum(math.prod(shape) for _, shape in shapes)
    flats, states = [], []
    for _ in range(clients):
        flat = torch.randn(params, generator=generator)
        state, offset = {}, 0
        for name, shape in shapes:
            size = math.prod(shape)
            state[name] = flat[offset : offset + size].view(shape)
            offset += size
        flats.append(flat)
        states.append(state)
    samples = torch.randint(500, 5000, (clients,), generator=generator).tolist()
    return flats, states, samples


def _race(runs: dict[str, Callable[[], object]], repeats: int) -> tuple[dict[str, float], dict[str, object]]:
    """Best time of each run, taking turns so that a noisy neighbour slows all of them alike.

    Before each timed run the caches are refilled with clean, unrelated data, so no run inherits the
    previous one's input (a head start) or its dirty lines (write-backs it would pay for). Returns the best
    seconds and the output of each run's untimed warm-up (first-touch page faults, thread-pool start).
    """
    outputs = {name: run() for name, run in runs.items()}
    scrub = torch.ones(_SCRUB_BYTES // 4)
    best = dict.fromkeys(runs, math.inf)
    for _ in range(repeats):
        for name, run in runs.items():
            scrub.sum()
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best, outputs


if __name__ == "__main__":
    sys.exit(main())
