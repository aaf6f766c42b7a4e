"""Does honest GPU work pass the site's CPU re-execution? Needs a CUDA device (runs on CPU only otherwise).

The worker client trains GPU-tier templates on CUDA (runner._train_device); the site re-executes units on
its CPU and refuses a result farther than MUNINN_REEXECUTION_TOLERANCE (1e-3, relative to the update) from
its own. GPU kernels round differently from CPU ones (TF32 convolutions, other reduction orders), so this
trains the same unit both ways, with the same code the client and the validator run, and prints the
distance the site would see, and the speed on each device. It also prints what the probe reports.

    python bench/gpu_reexecution.py [--templates resnet18,cnn,mlp] [--epochs 2]

Last line: JSON with each template's distance, the tolerance, and whether an honest GPU unit passes.
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "worker_client")]

from muninn_worker import probe, training, zoo  # noqa: E402
from muninn_worker.runner import _train_device  # noqa: E402
from muninn_worker.samples import synthetic_images  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from contributors.checks import reexecution_distance  # noqa: E402
from jobs import datasets, preparation  # noqa: E402

TOLERANCE = 1e-3  # settings.MUNINN_REEXECUTION_TOLERANCE's default
CASES = {
    "resnet18": ("images", {"base_width": 16, "image_size": 32, "batch_size": 32, "epochs": 2}),
    "cnn": ("images", {"image_size": 32, "batch_size": 32, "epochs": 2}),
    "mlp": ("digits", {"batch_size": 32, "epochs": 2}),
}


def _npz(X: np.ndarray, y: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, X=X, y=y)
    return buffer.getvalue()


def unit_inputs(template: str, data: str, hparams: dict):
    if data == "images":
        X, y = synthetic_images(seed=3, per_class=128, size=32)
    else:
        digits = load_digits()
        X, y = digits.data.astype(np.float32), digits.target.astype(np.int64)
    parsed = datasets.parse_dataset(_npz(X, y), "npz")
    hp = zoo.validate_hparams(template, hparams)
    config = zoo.model_config_for(template, parsed.profile, hp)
    parsed = datasets.parse_dataset(_npz(X, y), "npz", **preparation.parse_options(parsed.profile, config))
    X, y = preparation.samples(parsed, config)
    spec = zoo.get_template(template)
    state = spec.fit_state(zoo.init_state(template, config, 11), X, y)
    return config, hp, state, X, y


def train_on(device: str, template: str, config: dict, hp: dict, state: dict, X, y):
    model = zoo.build_model(template, config)
    model.load_state_dict(state)
    model.to(device)
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = training.train_local(model, X, y, epochs=hp["epochs"], batch_size=hp["batch_size"], lr=hp["lr"],
                                  momentum=hp.get("momentum", 0.0), seed=5,
                                  optimizer=zoo.get_template(template).optimizer)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    return {k: v.detach().cpu() for k, v in result.state_dict.items()}, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--templates", default=",".join(CASES))
    args = parser.parse_args()

    caps = probe.probe_device(quick=True)
    print(f"probe: backends={caps['backends']} gpus={caps['gpus']} cores={caps['cpu_cores']} "
          f"ram={caps['ram_bytes'] / 2**30:.0f} GiB torch={caps['torch_version']}")
    cuda = torch.cuda.is_available()
    rows, out = [], {"cuda": cuda, "tolerance": TOLERANCE, "templates": {}}
    for template in args.templates.split(","):
        data, hparams = CASES[template]
        config, hp, state, X, y = unit_inputs(template, data, hparams)
        cpu_state, cpu_s = train_on("cpu", template, config, hp, state, X, y)
        cpu_again, _ = train_on("cpu", template, config, hp, state, X, y)
        row = {"samples": int(X.shape[0]), "cpu_s": cpu_s,
               "cpu_vs_cpu": reexecution_distance(cpu_again, cpu_state, state),
               "client_device": str(_train_device(template))}
        if cuda:
            gpu_state, gpu_s = train_on("cuda", template, config, hp, state, X, y)
            row.update(gpu_s=gpu_s, gpu_vs_cpu=reexecution_distance(gpu_state, cpu_state, state))
            row["passes"] = row["gpu_vs_cpu"] <= TOLERANCE
        rows.append((template, row))
        out["templates"][template] = row

    print(f"\n{'template':10} {'client trains on':16} {'samples':>7} {'cpu s':>7} {'gpu s':>7} "
          f"{'cpu vs cpu':>11} {'gpu vs cpu':>11}  passes (≤ {TOLERANCE:g})")
    for template, r in rows:
        gpu_s = f"{r['gpu_s']:7.2f}" if "gpu_s" in r else "      -"
        gpu_d = f"{r['gpu_vs_cpu']:11.2e}" if "gpu_vs_cpu" in r else "          -"
        print(f"{template:10} {r['client_device']:16} {r['samples']:7d} {r['cpu_s']:7.2f} {gpu_s} "
              f"{r['cpu_vs_cpu']:11.2e} {gpu_d}  {r.get('passes', '-')}")
    out["gpu_units_pass"] = all(r.get("passes", True) for _, r in rows if r["client_device"] == "cuda")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
