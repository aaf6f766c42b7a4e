"""Bytes uploaded vs accuracy for FedAvg and DiLoCo with fp32 / fp16 / int8 updates, through the site's code.

Simulates 10 devices in-process with a non-IID split (Dirichlet 0.5 over classes) on two cases: scikit-learn's
digits with the `mlp` template, and the same images (8x8) with a wider `cnn` template (about 2x the
parameters). Every round runs what a real round runs, minus HTTP and the database:

  device  `training.train_local` (FedAvg: `epochs` passes; DiLoCo: `inner_steps` steps), then
          `codec.encode_update(trained, global, encoding)`: the bytes counted as uploaded;
  site    `contributors.checks.decode_update` (with the site's inflate limit) and `check_state`, then
          `federated.robust.aggregate` (the job's rule, FedAvg) and `federated.algorithms.next_global` (DiLoCo's outer
          Nesterov step with its momentum buffers, or FedAvg as it is), as `round_aggregate` does.

A central run (all training data on one machine, the same number of passes over the data) is the reference
accuracy. DiLoCo's inner steps default to one epoch of the mean shard, so both algorithms do the same work.

    .venv/bin/python bench/compression.py [--rounds 20] [--devices 10] [--inner-steps N] [--quick]

Prints a table; the last line is JSON: `int8_bytes_ratio` (int8 bytes / fp32 bytes; ≤ 0.25),
`int8_accuracy_drop` (the largest fp32 - int8 final accuracy over both cases and algorithms; ≤ 0.01) and
`rounds_to_97pct_of_central` (digits, the fewest rounds any algorithm/encoding needs; aim ≤ 20).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "worker_client")]
from contributors import checks  # noqa: E402  (pure: no Django)
from muninn_worker import codec, tensors, training, zoo  # noqa: E402
from muninn_worker.federated import algorithms, robust  # noqa: E402
from muninn_worker.federated.partition import dirichlet_split  # noqa: E402

CASES = {  # name: (template, hparams)
    "digits/mlp": ("mlp", {"hidden": [128]}),
    "digits/cnn": ("cnn", {"filters": [32, 64]}),
}


class Case:
    def __init__(self, name: str, template: str, hparams: dict, seed: int):
        digits = load_digits()
        images = template != "mlp"
        X = torch.tensor(digits.images if images else digits.data, dtype=torch.float32)
        X = X.unsqueeze(1) if images else X  # [n, 1, 8, 8] for the image templates
        y = torch.tensor(digits.target, dtype=torch.int64)
        order = np.random.default_rng(seed).permutation(len(y))
        n_test = len(order) // 5
        self.name, self.template = name, template
        self.hp = zoo.validate_hparams(template, hparams)
        profile = ({"kind": "image", "image_shape": [1, 8, 8], "num_classes": 10, "task": "classification"}
                   if images else {"kind": "table", "features": 64, "num_classes": 10, "task": "classification"})
        self.config = zoo.model_config_for(template, profile, self.hp)
        self.train = X[order[n_test:]], y[order[n_test:]]
        self.test = X[order[:n_test]], y[order[:n_test]]
        self.initial = zoo.get_template(template).fit_state(zoo.init_state(template, self.config, seed), *self.train)
        self.params = sum(v.numel() for v in self.initial.values() if v.is_floating_point())

    def model(self, state: dict) -> torch.nn.Module:
        model = zoo.build_model(self.template, self.config)
        model.load_state_dict(state)
        return model

    def accuracy(self, state: dict) -> float:
        return training.evaluate(self.model(state), *self.test)["accuracy"]

    def local(self, state: dict, X, y, *, seed: int, epochs: int = 1, inner_steps: int | None = None) -> dict:
        return training.train_local(self.model(state), X, y, epochs=epochs, batch_size=self.hp["batch_size"],
                                    lr=self.hp["lr"], momentum=self.hp.get("momentum", 0.0), seed=seed,
                                    inner_steps=inner_steps).state_dict


def federated(case: Case, shards, *, rounds: int, scheme: algorithms.Scheme) -> dict:
    global_state, momentum, curve, sent = case.initial, None, [], []
    for r in range(rounds):
        global_bytes = len(tensors.state_dict_to_bytes(global_state))
        decoded, samples = [], []
        for d, (X, y) in enumerate(shards):
            new = case.local(global_state, X, y, seed=1000 * r + d, inner_steps=scheme.inner_steps)
            upload = codec.encode_update(new, global_state, scheme.update_encoding)  # the device
            sent.append(len(upload))
            state = checks.decode_update(upload, global_state, scheme.update_encoding,  # the site
                                         max_inflated_bytes=checks.max_update_bytes(global_bytes))
            checks.check_state(state, global_state)
            decoded.append(state)
            samples.append(len(y))
        combined = robust.aggregate("fedavg", decoded, samples, global_state)
        global_state, momentum = algorithms.next_global(scheme, global_state, combined, momentum)
        curve.append(case.accuracy(global_state))
    return {"accuracy": curve[-1], "curve": curve, "bytes_per_device_round": float(np.mean(sent))}


def run_case(case: Case, args) -> tuple[float, dict]:
    rng = np.random.default_rng(args.seed)
    split = dirichlet_split(case.train[1].numpy(), args.devices, 0.5, rng)
    shards = [(case.train[0][idx], case.train[1][idx]) for idx in split if len(idx)]
    inner_steps = args.inner_steps or math.ceil(np.mean([len(s[1]) for s in shards]) / case.hp["batch_size"])
    central = case.accuracy(case.local(case.initial, *case.train, seed=1, epochs=args.rounds))
    results = {}
    for algorithm in algorithms.ALGORITHMS:
        for encoding in codec.ENCODINGS:
            scheme = algorithms.scheme(algorithm=algorithm, update_encoding=encoding,
                                       inner_steps=inner_steps if algorithm == "diloco" else None)
            run = federated(case, shards, rounds=args.rounds, scheme=scheme)
            hit = next((i + 1 for i, a in enumerate(run["curve"]) if a >= 0.97 * central), None)
            results[f"{algorithm}/{encoding}"] = {**run, "rounds_to_97pct": hit}
    print(f"{case.name}: {case.template} {case.config}, {case.params:,} parameters; {len(shards)} devices, "
          f"Dirichlet(0.5) shard sizes {sorted(len(s[1]) for s in shards)}; {args.rounds} rounds; FedAvg 1 local "
          f"epoch, DiLoCo {inner_steps} inner steps (outer lr {algorithms.DEFAULT_OUTER_LR}, momentum "
          f"{algorithms.DEFAULT_OUTER_MOMENTUM})")
    print(f"central accuracy {central:.4f}; 97% of it = {0.97 * central:.4f}")
    print(f"  {'algorithm/encoding':<18} {'bytes/device/round':>18} {'vs fp32':>8} {'final acc':>10} "
          f"{'rounds to 97%':>14}")
    for key, r in results.items():
        fp32 = results[key.split("/")[0] + "/fp32"]["bytes_per_device_round"]
        print(f"  {key:<18} {r['bytes_per_device_round']:>18,.0f} {r['bytes_per_device_round'] / fp32:>8.3f} "
              f"{r['accuracy']:>10.4f} {str(r['rounds_to_97pct'] or '-'):>14}")
    print()
    return central, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--inner-steps", type=int, default=None, help="DiLoCo's (default: one mean shard's epoch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="digits/mlp only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.monotonic()

    summary = {}
    for name, (template, hparams) in CASES.items():
        if args.quick and name != "digits/mlp":
            continue
        central, results = run_case(Case(name, template, hparams, args.seed), args)
        summary[name] = (central, results)

    ratios, drops = [], []
    for _, results in summary.values():
        for algorithm in algorithms.ALGORITHMS:
            fp32, int8 = results[f"{algorithm}/fp32"], results[f"{algorithm}/int8"]
            ratios.append(int8["bytes_per_device_round"] / fp32["bytes_per_device_round"])
            drops.append(fp32["accuracy"] - int8["accuracy"])
    hits = [r["rounds_to_97pct"] for r in summary["digits/mlp"][1].values() if r["rounds_to_97pct"]]
    print(f"{time.monotonic() - started:.0f} s")
    print(json.dumps({
        "int8_bytes_ratio": round(max(ratios), 4),
        "int8_accuracy_drop": round(max(drops), 4),
        "rounds_to_97pct_of_central": min(hits) if hits else None,
        "central_accuracy": {name: round(c, 4) for name, (c, _) in summary.items()},
        "results": {f"{name}/{key}": {"bytes": round(v["bytes_per_device_round"]), "accuracy": round(v["accuracy"], 4),
                                      "rounds_to_97pct": v["rounds_to_97pct"]}
                    for name, (_, results) in summary.items() for key, v in results.items()},
    }))


if __name__ == "__main__":
    main()
