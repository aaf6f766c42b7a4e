"""The browser tier's arithmetic against torch's: the same `mlp` units trained in headless chromium (the page's
own JavaScript, static/muninn/browser/trainer.js) and in torch (`training.train_local`, the reference client),
every browser segment re-trained by the site's validator (`training.train_segment` from the browser's own start
checkpoint, as a segment check does) and judged by `contributors.checks.segment_distance`.

Calibration: `--units` units (digits-sized: 64 features, 10 classes, hidden [128], batch 32; the odd ones a
regression) are trained in the browser with a checkpoint after every step, so each segment of k = 1 … 32 steps
at every start is one more distance; the envelope at k is the worst one at any length ≤ k, as
bench/verification.py takes it. With --write it goes into contributors/data/tolerances.json under "browser":
the site checks a browser device's segments at MULTIPLE × the larger of that and the template's own envelope.

Speed: one larger unit (`--speed-samples` rows, 2 epochs) timed in both (torch on all this machine's threads
and on one), its segments at the template's k judged at the tolerance the site applies.

    .venv/bin/python bench/browser_training.py [--units 6] [--speed-samples 4000] [--write]

The last line is JSON: distance (the worst browser segment at the template's k), tolerance, passes,
browser_samples_per_s, torch_samples_per_s (torch at its faster thread setting; both are given too, with the
envelope per k and the units). A full run takes about a minute on the shared 2-core machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform"), str(ROOT / "worker_client")]

from contributors import tolerances  # noqa: E402
from contributors.checks import segment_distance  # noqa: E402
from muninn_worker import segments, training  # noqa: E402
from scripts.browser_js import js_page, mlp_case, train_in_browser  # noqa: E402

KS = (1, 2, 4, 8, 16, 32)
SHAPE = {"features": 64, "classes": 10, "hidden": (128,), "batch_size": 32, "lr": 0.05, "momentum": 0.9}


def distances_by_k(case, trained) -> dict[int, float]:
    """Worst distance at each k over every segment start of a unit trained with a checkpoint per step."""
    states, steps = trained["checkpoints"], trained["receipt"]["steps"]
    worst = dict.fromkeys(KS, 0.0)
    for k in KS:
        for first in range(0, steps - k + 1, k):
            start, end = states[first], states[first + k]
            validator, _ = training.train_segment(case.fresh_model(), case.X, case.y, start, first_step=first,
                                                  steps=k, **case.spec)
            worst[k] = max(worst[k], segment_distance(
                device_weights=end.weights, device_optimizer=end.optimizer, validator_weights=validator.weights,
                validator_optimizer=validator.optimizer, start_weights=start.weights))
    for smaller, larger in zip(KS, KS[1:]):  # the worst at any length <= k, as bench/verification.py takes it
        worst[larger] = max(worst[larger], worst[smaller])
    return worst


def unit_distance(case, trained, k: int) -> float:
    """The worst segment of a unit committed at k, as a check of every segment would find it."""
    states = trained["checkpoints"]
    bounds = segments.boundaries(trained["receipt"]["steps"], k)
    worst = 0.0
    for j in range(len(bounds) - 1):
        validator, _ = training.train_segment(case.fresh_model(), case.X, case.y, states[j],
                                              first_step=bounds[j], steps=bounds[j + 1] - bounds[j], **case.spec)
        worst = max(worst, segment_distance(
            device_weights=states[j + 1].weights, device_optimizer=states[j + 1].optimizer,
            validator_weights=validator.weights, validator_optimizer=validator.optimizer,
            start_weights=states[j].weights))
    return worst


def torch_speed(case, threads: int | None, repeats: int = 3) -> float:
    """torch's samples/s on the unit: the best of `repeats` runs (the first also warms it up)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        best = 0.0
        for _ in range(repeats):
            result = training.train_local(case.fresh_model(), case.X, case.y, **case.spec)
            best = max(best, result.samples * case.spec["epochs"] / result.train_seconds)
        return best
    finally:
        torch.set_num_threads(before)


def write_envelope(envelope: dict[int, float], source: str) -> None:
    path = tolerances.DATA
    text = path.read_text()
    data = json.loads(text)
    data["browser"] = {"source": source, "templates": {"mlp": {"envelope": {str(k): float(f"{v:.3g}")
                                                                           for k, v in envelope.items()}}}}
    lines = ["{", f'  "multiple": {data["multiple"]},', f'  "floor": {data["floor"]!r},',
             f'  "source": {json.dumps(data["source"])},', '  "templates": {']
    names = list(data["templates"])
    for i, name in enumerate(names):
        lines.append(f'    {json.dumps(name)}: {json.dumps(data["templates"][name])}{"," if i < len(names) - 1 else ""}')
    lines += ["  },", f'  "browser": {json.dumps(data["browser"])}', "}", ""]
    json.loads("\n".join(lines))
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=6, help="calibration units (default 6)")
    parser.add_argument("--speed-samples", type=int, default=4000, help="rows of the timed unit (default 4000)")
    parser.add_argument("--write", action="store_true", help="record the browser envelope in tolerances.json")
    args = parser.parse_args()

    k = tolerances.segment_steps("mlp")
    envelope = dict.fromkeys(KS, 0.0)
    with js_page() as page:
        print(f"calibration: {args.units} mlp units, a checkpoint after every step, segments of k = {KS}")
        for i in range(args.units):
            task = "regression" if i % 2 else "classification"
            case = mlp_case(task=task, samples=300 + 37 * i, segment_steps=1, seed=1000 + i, epochs=4, **SHAPE)
            worst = distances_by_k(case, train_in_browser(page, case))
            envelope = {kk: max(envelope[kk], worst[kk]) for kk in KS}
            print(f"  unit {i} {task:<14} " + "  ".join(f"k={kk}: {worst[kk]:.2e}" for kk in KS))

        case = mlp_case(task="classification", samples=args.speed_samples, segment_steps=k, seed=7, epochs=2,
                        **SHAPE)
        runs = [train_in_browser(page, case) for _ in range(2)]  # the first also warms the JIT up
        trained = min(runs, key=lambda run: run["receipt"]["train_seconds"])
        browser_speed = case.unit["samples"] * case.spec["epochs"] / trained["receipt"]["train_seconds"]
    distance = unit_distance(case, trained, k)
    torch_all, torch_one = torch_speed(case, None), torch_speed(case, 1)
    if args.write:
        source = (f"bench/browser_training.py --units {args.units}, {datetime.date.today()}, headless chromium "
                  f"against torch {torch.__version__} on {platform.machine()}: worst browser segment_distance at "
                  "any length <= k")
        write_envelope(envelope, source)
        tolerances.table.cache_clear()
    tolerance = tolerances.tolerance("mlp", k, backend="browser")  # what the site applies to a browser device
    passes = distance <= tolerance

    print()
    print(f"{'k':>4} {'browser envelope':>17} {'template envelope':>18} {'browser tolerance':>18}")
    for kk in KS:
        print(f"{kk:>4} {envelope[kk]:>17.3g} {tolerances.envelope('mlp', kk):>18.3g} "
              f"{tolerances.tolerance('mlp', kk, backend='browser'):>18.3g}")
    print()
    print(f"timed unit: {case.unit['samples']} rows x {case.spec['epochs']} epochs, "
          f"{trained['receipt']['steps']} steps, k = {k}")
    print(f"  worst segment distance {distance:.3g}  tolerance {tolerance:.3g}  {'passes' if passes else 'FAILS'}")
    print(f"  browser (chromium, JS)  {browser_speed:>10,.0f} samples/s")
    print(f"  torch ({torch.get_num_threads()} threads)      {torch_all:>10,.0f} samples/s")
    print(f"  torch (1 thread)        {torch_one:>10,.0f} samples/s")
    if args.write:
        print(f"wrote the browser envelope to {tolerances.DATA.relative_to(ROOT)}")
    print(json.dumps({"distance": distance, "tolerance": tolerance, "passes": passes,
                      "browser_samples_per_s": round(browser_speed, 1),
                      "torch_samples_per_s": round(max(torch_all, torch_one), 1), "torch_threads_samples_per_s": round(torch_all, 1),
                      "torch_1thread_samples_per_s": round(torch_one, 1), "segment_steps": k,
                      "envelope": {str(kk): envelope[kk] for kk in KS}, "units": args.units}))


if __name__ == "__main__":
    main()
