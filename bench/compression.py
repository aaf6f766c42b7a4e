"""Bytes uploaded vs accuracy for FedAvg and DiLoCo with fp32 / fp16 / int8 updates.

Simulates 10 devices in-process on scikit-learn's digits with a non-IID split (Dirichlet 0.5 over classes),
using the site's and client's own code: the zoo's MLP, `train_local`, `codec.encode_update/decode_update`,
`fedavg` and `diloco_outer_step`. A central run (all training data on one machine, the same number of
passes) is the reference accuracy.

    .venv/bin/python bench/compression.py [--rounds 30] [--devices 10] [--hidden 128]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "worker_client")]
from jobs.aggregation import diloco_outer_step, fedavg  # noqa: E402
from muninn_worker import codec, training, zoo  # noqa: E402


def dirichlet_split(y: np.ndarray, devices: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Per class, share its samples among devices by Dirichlet(alpha) proportions (Hsu et al. 2019)."""
    parts: list[list[int]] = [[] for _ in range(devices)]
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        cuts = (np.cumsum(rng.dirichlet([alpha] * devices)) * len(idx)).astype(int)[:-1]
        for d, chunk in enumerate(np.split(idx, cuts)):
            parts[d].extend(chunk.tolist())
    return [np.array(sorted(p), dtype=np.int64) for p in parts]


def setup(hidden: int, seed: int):
    digits = load_digits()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(digits.target))
    n_test = len(order) // 5
    X = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    test, train = order[:n_test], order[n_test:]
    config = {"in_features": 64, "num_classes": 10, "hidden": [hidden]}
    state = zoo.init_state("mlp", config, seed)
    std = X[train].std(dim=0)
    state["norm_mean"], state["norm_std"] = X[train].mean(dim=0), torch.where(std > 1e-6, std, torch.ones_like(std))
    return config, state, (X[train], y[train]), (X[test], y[test])


def accuracy(config, state, test) -> float:
    model = zoo.build_model("mlp", config)
    model.load_state_dict(state)
    return training.evaluate(model, *test)["accuracy"]


def train(config, state, X, y, *, epochs, seed, lr=0.05):
    model = zoo.build_model("mlp", config)
    model.load_state_dict(state)
    return training.train_local(model, X, y, epochs=epochs, batch_size=32, lr=lr, momentum=0.9, seed=seed).state_dict


def federated(config, state, shards, test, *, rounds, algorithm, encoding, epochs) -> dict:
    global_state, momentum, accs, sent = state, None, [], []
    for r in range(rounds):
        decoded, weights = [], []
        for d, (X, y) in enumerate(shards):
            new = train(config, global_state, X, y, epochs=epochs, seed=1000 * r + d)
            data = codec.encode_update(new, global_state, encoding)
            sent.append(len(data))
            decoded.append(codec.decode_update(data, global_state, encoding))
            weights.append(len(y))
        average = fedavg(decoded, weights)
        if algorithm == "diloco":
            global_state, momentum = diloco_outer_step(global_state, average, momentum, lr=0.7, beta=0.9)
        else:
            global_state = average
        accs.append(accuracy(config, global_state, test))
    return {"accuracy": accs[-1], "curve": accs, "bytes_per_device_round": float(np.mean(sent))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=1, help="local epochs (inner steps) per round")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.monotonic()

    config, state, (X, y), test = setup(args.hidden, args.seed)
    split = dirichlet_split(y.numpy(), args.devices, 0.5, np.random.default_rng(args.seed))
    shards = [(X[idx], y[idx]) for idx in split if len(idx)]
    central = accuracy(config, train(config, state, X, y, epochs=args.rounds * args.epochs, seed=1), test)
    target = 0.97 * central

    results = {}
    for algorithm in ("fedavg", "diloco"):
        for encoding in codec.ENCODINGS:
            run = federated(config, state, shards, test, rounds=args.rounds, algorithm=algorithm,
                            encoding=encoding, epochs=args.epochs)
            hit = next((i + 1 for i, a in enumerate(run["curve"]) if a >= target), None)
            results[f"{algorithm}/{encoding}"] = {**run, "rounds_to_97pct": hit}

    print(f"digits, {len(shards)} devices, Dirichlet(0.5) non-IID (shard sizes {sorted(len(s[1]) for s in shards)}),"
          f" MLP hidden {args.hidden}, {args.rounds} rounds x {args.epochs} local epoch(s)")
    print(f"central accuracy {central:.4f}; 97% of it = {target:.4f}\n")
    print(f"{'algorithm/encoding':<18} {'bytes/device/round':>18} {'vs fp32':>8} {'final acc':>10} {'rounds to 97%':>14}")
    for key, r in results.items():
        fp32 = results[key.split("/")[0] + "/fp32"]["bytes_per_device_round"]
        print(f"{key:<18} {r['bytes_per_device_round']:>18,.0f} {r['bytes_per_device_round'] / fp32:>8.3f} "
              f"{r['accuracy']:>10.4f} {str(r['rounds_to_97pct'] or '-'):>14}")
    fed32, fed8 = results["fedavg/fp32"], results["fedavg/int8"]
    hits = [r["rounds_to_97pct"] for r in results.values() if r["rounds_to_97pct"]]
    print(f"\n{time.monotonic() - started:.0f} s")
    print(json.dumps({
        "int8_bytes_ratio": round(fed8["bytes_per_device_round"] / fed32["bytes_per_device_round"], 4),
        "int8_accuracy_drop": round(fed32["accuracy"] - fed8["accuracy"], 4),
        "rounds_to_97pct_of_central": min(hits) if hits else None,
        "central_accuracy": round(central, 4),
        "results": {k: {"bytes": round(v["bytes_per_device_round"]), "accuracy": round(v["accuracy"], 4),
                        "rounds_to_97pct": v["rounds_to_97pct"]} for k, v in results.items()},
    }))


if __name__ == "__main__":
    main()
