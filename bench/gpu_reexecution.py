"""Does honest GPU work pass the site's segment checks? Trains units of every template on CUDA and re-trains their
segments on the CPU, as the site's validator would.

The worker client trains with segment checkpoints (training.train_local(segment_steps=k, on_boundary=...)),
k being the template's segment_steps from contributors/data/tolerances.json. Here the GPU does that under
training.deterministic_cuda(); then every segment (or --segments N of them) is re-trained on the CPU from the
GPU's own checkpoint at its start (training.train_segment) and compared with the GPU's checkpoint at its end
by contributors.checks.segment_distance, against contributors.tolerances.tolerance(template, k). A second CUDA
run must give bitwise the same checkpoints (two devices of the same kind agree exactly).

Without CUDA it still runs, with the CPU under numerics="f64" (the stand-in for another device's arithmetic)
in the GPU's place, and says so; gpu_units_pass is then null. It also prints what the probe reports.

    python bench/gpu_reexecution.py [--templates mlp,cnn,resnet18,transformer,lora] [--segments all] [--units 4]
                                    [--first-unit 0] [--ks 1,2,4,8,16,32] [--save FILE]

--units units per template (different shards, seeds and starts), each at the template's own k and at every
--ks; --save writes every distance (bench/data/gpu-h100-2026-11-24.json summarises such a run, and
bench/verification.py folds it into the envelopes; a check of units after --first-unit is then held out).

Last line: JSON with gpu_units_pass (every GPU segment within tolerance), and per template (resnet18 at lr
0.01 and 0.05) the segment length, tolerance, worst distance and whether the device's two runs were equal.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform"), str(ROOT / "worker_client"), str(ROOT / "bench")]

import segment_cases  # noqa: E402
from muninn_worker import probe, training  # noqa: E402
from muninn_worker.runner import _train_device  # noqa: E402
from muninn_worker.segments import Checkpoint  # noqa: E402

from contributors import tolerances  # noqa: E402
from contributors.checks import checkpoint_distance  # noqa: E402

UNIT = 1  # which unit of bench/segment_cases.py (a shard of a 3-device round, trained from the job's start)


def device_run(case: segment_cases.Case, unit: segment_cases.Unit, k: int, *, cuda: bool) -> tuple[list, float]:
    """Train the unit from the job's initial weights with checkpoints every k steps: on CUDA (deterministic),
    or on the CPU under the f64 stand-in. (checkpoints, seconds)."""
    model = case.model()
    if unit.first_step == 0:  # a unit of a later round starts from that round's weights
        model.load_state_dict(unit.start.weights)
    if cuda:
        model.to("cuda")
        torch.cuda.synchronize()
    checkpoints: list[Checkpoint] = []
    started = time.perf_counter()
    training.train_local(model, unit.X, unit.y, seed=unit.seed, segment_steps=k,
                         on_boundary=lambda i, c: checkpoints.append(c),
                         numerics="native" if cuda else "f64", **case.train_args())
    if cuda:
        torch.cuda.synchronize()
    return checkpoints, time.perf_counter() - started


def same(a: list[Checkpoint], b: list[Checkpoint]) -> bool:
    return len(a) == len(b) and all(
        all(torch.equal(x.weights[n], y.weights[n]) for n in x.weights)
        and all(torch.equal(x.optimizer[n], y.optimizer[n]) for n in x.optimizer) for x, y in zip(a, b))


def check_unit(case: segment_cases.Case, number: int, k: int, *, cuda: bool, sample: int | None) -> dict:
    """Unit `number` of the case trained on the device with checkpoints every k steps, twice; its segments
    (or `sample` of them) re-trained on the CPU from the device's own checkpoints."""
    unit = segment_cases.make_unit(case, number)
    checkpoints, device_s = device_run(case, unit, k, cuda=cuda)
    again, _ = device_run(case, unit, k, cuda=cuda)
    steps = math.ceil(len(unit.y) / case.hp["batch_size"]) * case.hp["epochs"]
    segments = len(checkpoints) - 1
    chosen = range(segments) if sample is None else sorted(
        torch.randperm(segments, generator=torch.Generator().manual_seed(number))[:sample].tolist())
    validator = case.model()
    distances, started = [], time.perf_counter()
    for j in chosen:
        first = j * k
        end, _ = training.train_segment(validator, unit.X, unit.y, checkpoints[j], first_step=first,
                                        steps=min(k, steps - first), seed=unit.seed, **case.train_args())
        device = checkpoints[j + 1]
        distances.append(checkpoint_distance(device, end, checkpoints[j]))
    return {"samples": len(unit.y), "steps": steps, "segments": segments, "distances": distances,
            "device_runs_equal": same(checkpoints, again), "device_s": device_s,
            "validator_s": time.perf_counter() - started}


def check_case(case: segment_cases.Case, *, units: int, ks: list[int], cuda: bool, sample: int | None,
               first_unit: int = 0) -> dict:
    """Every k of `ks` (and the template's own): `units` units each, from unit `first_unit` on. The verdict is at
    the template's k."""
    own = tolerances.segment_steps(case.template)
    by_k = {}
    for k in sorted(set(ks) | {own}):
        runs = [check_unit(case, number, k, cuda=cuda, sample=sample)
                for number in range(first_unit, first_unit + units)]
        distances = [d for r in runs for d in r["distances"]]
        by_k[k] = {"tolerance": tolerances.tolerance(case.template, k), "distances": distances,
                   "worst_distance": max(distances), "median_distance": sorted(distances)[len(distances) // 2],
                   "device_runs_equal": all(r["device_runs_equal"] for r in runs),
                   "device_s": sum(r["device_s"] for r in runs), "validator_s": sum(r["validator_s"] for r in runs)}
        by_k[k]["within_tolerance"] = sum(d <= by_k[k]["tolerance"] for d in distances)
        print(f"  {case.name} k={k}: {len(distances)} segments, worst {by_k[k]['worst_distance']:.2e} "
              f"(tolerance {by_k[k]['tolerance']:.2e})", file=sys.stderr, flush=True)
    r = by_k[own]
    return {"template": case.template, "segment_steps": own, "units": units, "checked": len(r["distances"]),
            "samples": runs[0]["samples"], "steps": runs[0]["steps"], **{key: r[key] for key in (
                "tolerance", "worst_distance", "median_distance", "within_tolerance", "device_runs_equal",
                "device_s", "validator_s")},
            "client_device": str(_train_device(case.template)), "by_k": by_k}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--templates", default="mlp,cnn,resnet18,transformer,lora")
    parser.add_argument("--segments", default="all", help="segments re-trained per unit: all, or a number")
    parser.add_argument("--resnet-width", type=int, default=8, help="as calibrated by bench/verification.py")
    parser.add_argument("--units", type=int, default=4, help="units per template and k (different shards, "
                                                              "seeds and starts: bench/segment_cases.py)")
    parser.add_argument("--first-unit", type=int, default=0,
                        help="the first unit's number (units other than a calibration's: a held-out check)")
    parser.add_argument("--ks", default="", help="other segment lengths to measure, e.g. 1,2,4,8,16,32 "
                                                 "(the verdict is at each template's own)")
    parser.add_argument("--save", default="", help="write every distance measured to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(1)

    caps = probe.probe_device(quick=True)
    print(f"probe: backends={caps['backends']} gpus={caps['gpus']} cores={caps['cpu_cores']} "
          f"ram={caps['ram_bytes'] / 2**30:.0f} GiB torch={caps['torch_version']}")
    cuda = torch.cuda.is_available()
    if cuda:
        training.deterministic_cuda()
        print(f"device: {torch.cuda.get_device_name(0)} (deterministic CUDA); validator: this CPU, 1 thread")
    else:
        print("no CUDA here: the CPU under numerics='f64' (float64 rounded to float32 after every step) stands in "
              "for the GPU; gpu_units_pass is null")
    sample = None if args.segments == "all" else int(args.segments)
    wanted = args.templates.split(",")
    rows = {}
    for case in segment_cases.cases(resnet_width=args.resnet_width):
        if case.template in wanted:
            rows[case.name] = check_case(case, units=args.units, cuda=cuda, sample=sample, first_unit=args.first_unit,
                                         ks=[int(k) for k in args.ks.split(",") if k])

    device = "gpu" if cuda else "f64"
    if args.save:
        Path(args.save).write_text(json.dumps({"cuda": cuda, "device": torch.cuda.get_device_name(0) if cuda else
                                               "cpu f64", "torch": torch.__version__,
                                               "cases": {n: {"template": r["template"], "by_k": r["by_k"]}
                                                         for n, r in rows.items()}}))
    print(f"\n{'case':16} {'client trains on':16} {'samples':>7} {'steps':>5} {'k':>3} {'checked':>7} "
          f"{'tolerance':>9} {'worst':>9} {'median':>9} {'within':>6} {device + ' runs equal':>15} "
          f"{device + ' s':>6} {'cpu s':>6}")
    for name, r in rows.items():
        print(f"{name:16} {r['client_device']:16} {r['samples']:>7} {r['steps']:>5} {r['segment_steps']:>3} "
              f"{r['checked']:>7} {r['tolerance']:>9.2e} {r['worst_distance']:>9.2e} "
              f"{r['median_distance']:>9.2e} {r['within_tolerance']:>6} {str(r['device_runs_equal']):>15} "
              f"{r['device_s']:>6.2f} {r['validator_s']:>6.2f}")
    passes = all(r["within_tolerance"] == r["checked"] for r in rows.values())
    print(json.dumps({"cuda": cuda, "device": device, "gpu_units_pass": passes if cuda else None,
                      "stand_in_passes": None if cuda else passes,
                      "templates": {name: {k: r[k] for k in ("segment_steps", "tolerance", "worst_distance",
                                                             "checked", "within_tolerance", "device_runs_equal")}
                                    for name, r in rows.items()}}))


if __name__ == "__main__":
    main()
