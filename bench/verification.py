"""Calibrate segment checks: how far honest segments land from the validator, how far cheats land, and the
segment length and tolerance each template gets (contributors/data/tolerances.json with --write).

For every template (resnet18 at lr 0.01 and 0.05) it takes honest units (bench/segment_cases.py: different
shards and seeds, starting at a unit's first step or mid-unit), then trains the segments of k = 1, 2, 4, 8, 16,
32 steps from there three ways: natively on one CPU thread (the validator), under numerics="f64" (float64 rounded to
float32 after every step: the stand-in for another device's arithmetic, which tracks a real H100 against a
CPU, shared/measurements/gpu-h100-segments.md) and, for every fourth unit, on two threads. Each distance is
contributors.checks.segment_distance, the one the site uses. The envelope at k is the worst honest distance
seen at any length ≤ k (so tolerances never shrink as k grows); tolerance = max(FLOOR, MULTIPLE × envelope).

Cheats, from the same start, judged at that tolerance (a cheater forges Adam's step counters, which the site
would otherwise refuse outright):
  saving compute  skip_last_step (k - 1 steps), partial_shard (ceil(k / 3) steps on the first third of the
                  shard, as tests/attacks/cheater.py trains a third), no_training (the start again), replay
                  (the previous unit's state at the same boundary), random_noise (random weights)
  other           one_batch_swapped (the last step on another batch of the shard), lr_x0.95, noise_1e-3
                  (Gaussian noise of 1e-3 × the update's norm on an honest result), scaled_x100, sign_flip
                  (of the honest update), nan (one NaN in an honest result)
A template's segment_steps is the largest k at which every compute-saving cheat of every unit lands at
≥ SEPARATION × tolerance, with MULTIPLE × envelope < CAP and a default unit's verification overhead at most
MAX_OVERHEAD (--max-overhead). Envelopes also cover a real GPU's worst segments (--gpu, bench/data/: a summary
of bench/gpu_reexecution.py runs), and mlp and cnn get --tail-units more honest units (TAIL_TEMPLATES).

Why MULTIPLE = 10 and FLOOR = 1e-5 (the figures are this bench's, 2026-11-23, and the H100 measurements'):
  - the stand-in is not a GPU: on the H100 a deterministic GPU landed up to 1.2x farther from the CPU than the
    stand-in did (resnet18 lr 0.01, k = 64: 5.6e-2 vs 4.6e-2) and elsewhere closer; 10x covers that;
  - an envelope is the maximum of 20 units, not a bound. Where honest drift is steady (mlp, lora, transformer:
    max/median ≤ 6) 10x the maximum leaves a wide margin, and the held-out check (calibrate on the even units,
    judge the odd ones: the "held" column) finds nothing beyond it. Where drift starts to grow fast the tail is
    heavy: cnn at k = 32 (one unit 15x the median; one held-out segment beyond), resnet18 (max/median up to
    270). There the data argue for a shorter segment rather than a larger multiple: a multiple of 100 would
    fail the cap for the transformer at every k;
  - at 10x the compute-saving cheats still land ≥ 3x the tolerance away at the chosen k (that is how k is
    chosen); lr x 0.95 (~5e-2) is caught everywhere but resnet18, noise of 1e-3 only where the envelope is
    below 1e-4 (mlp, cnn, lora);
  - the floor covers a validator with another thread count where that is nearly the whole difference (2-thread
    distances ≤ 1e-6 for mlp, cnn and lora, against a floor 10x above); the transformer's (up to 1.1e-4) and
    resnet18's thread distances are inside their envelopes, which count them.

    .venv/bin/python bench/verification.py [--units 20] [--tail-units 200] [--quick] [--write]
                                           [--load var/verification-distances.json] [--max-overhead 0.03]

A full run took 11 minutes on the shared 2-core machine (2026-11-24; resnet18's float64 convolutions are most
of it; --quick: about 4); it saves the raw distances, and --load judges them again in seconds.

The last line is JSON: false_rejections, cheater_expected_gain, verification_overhead and per template its
segment_steps, tolerance, envelope, units, false rejections and the attacks caught at that k.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform"), str(ROOT / "worker_client"), str(ROOT / "bench")]

import segment_cases  # noqa: E402
import segment_market  # noqa: E402
from muninn_worker.segments import Checkpoint  # noqa: E402

from contributors import reputation  # noqa: E402
from contributors.checks import checkpoint_distance  # noqa: E402

KS = (1, 2, 4, 8, 16, 32)
MULTIPLE = 10
FLOOR = 1e-5
SEPARATION = 3.0  # a compute-saving cheat must land at least this many tolerances away
CAP = 1e-2  # MULTIPLE × envelope must stay below this
MAX_OVERHEAD = 0.03  # and a default unit's verification overhead at most this (the goal), by default
SAVING = ("skip_last_step", "partial_shard", "no_training", "replay", "random_noise")
OTHER = ("one_batch_swapped", "lr_x0.95", "noise_1e-3", "scaled_x100", "sign_flip", "nan")
ATTACKS = SAVING + OTHER
SHORT = {"skip_last_step": "skip", "partial_shard": "part", "no_training": "none", "replay": "repl",
         "random_noise": "rand", "one_batch_swapped": "swap", "lr_x0.95": "lr95", "noise_1e-3": "nois",
         "scaled_x100": "x100", "sign_flip": "flip", "nan": "nan"}
TOLERANCES = ROOT / "contributors" / "data" / "tolerances.json"
RESULTS = ROOT / "var" / "verification-distances.json"
GPU = ROOT / "bench" / "data" / "gpu-h100-2026-11-24.json"
# Templates with kinks (ReLU, max-pool) and cheap steps: under other rounding one sample can land on the other
# side of a kink and move a row of the update (about 1 unit in 100 for cnn at k = 16, measured), so their
# envelopes are taken over many more honest units than the cheats need.
TAIL_TEMPLATES = ("mlp", "cnn")


# ------------------------------------------------------------------------------------------ measuring


def forged(state: Checkpoint, honest: Checkpoint) -> Checkpoint:
    """`state` with Adam's step counters set to the honest ones."""
    optimizer = {k: (honest.optimizer[k] if k.startswith("step:") else v) for k, v in state.optimizer.items()}
    return Checkpoint(state.weights, optimizer)


def _floating(weights: dict) -> list[str]:
    return [k for k, v in weights.items() if v.is_floating_point()]


def _noisy(honest: Checkpoint, start: Checkpoint, relative: float, generator: torch.Generator) -> Checkpoint:
    moved = [k for k in _floating(honest.weights) if not torch.equal(honest.weights[k], start.weights[k])]
    noise = {k: torch.randn(honest.weights[k].shape, generator=generator) for k in moved}
    update = math.sqrt(sum(float((honest.weights[k].double() - start.weights[k].double()).pow(2).sum()) for k in moved))
    size = math.sqrt(sum(float(v.double().pow(2).sum()) for v in noise.values()))
    scale = relative * update / size
    return Checkpoint({k: (v + scale * noise[k] if k in noise else v) for k, v in honest.weights.items()},
                      honest.optimizer)


def cheats(k: int, unit: segment_cases.Unit, native: dict, lr95: dict | None, partial: dict, swapped: Checkpoint,
           previous: dict | None, generator: torch.Generator) -> dict[str, Checkpoint]:
    start, honest = unit.start, native[k]
    floating = _floating(honest.weights)

    def weights(fn) -> dict:
        return {name: (fn(name, v) if name in floating else v) for name, v in honest.weights.items()}

    out = {"partial_shard": forged(partial[math.ceil(k / 3)], honest),
           "no_training": forged(start, honest),
           "random_noise": forged(Checkpoint(weights(lambda _, v: torch.randn(v.shape, generator=generator)),
                                             start.optimizer), honest),
           "one_batch_swapped": swapped,
           "noise_1e-3": _noisy(honest, start, 1e-3, generator),
           "scaled_x100": Checkpoint(weights(lambda n, v: start.weights[n] + 100 * (v - start.weights[n])),
                                     honest.optimizer),
           "sign_flip": Checkpoint(weights(lambda n, v: start.weights[n] - (v - start.weights[n])), honest.optimizer)}
    if k > 1:
        out["skip_last_step"] = forged(native[k - 1], honest)
    if lr95 is not None:
        out["lr_x0.95"] = lr95[k]
    if previous is not None:
        out["replay"] = forged(previous[k], honest)
    last = floating[-1]
    bad = dict(honest.weights)
    bad[last] = bad[last].clone()
    bad[last].view(-1)[0] = float("nan")
    out["nan"] = Checkpoint(bad, honest.optimizer)
    return out


def measure_unit(unit: segment_cases.Unit, previous: dict | None, *, threads: bool) -> tuple[dict, dict]:
    """{k: {"honest": f64 distance, "threads": 2-thread distance or None, "attacks": {name: distance}}}, and
    the native states at each k (the next unit's replay)."""
    kmax, w, start = max(KS), unit.first_step, unit.start
    native = unit.train(start, first_step=w, steps=kmax, keep=set(KS) | {k - 1 for k in KS if k > 1})
    f64 = unit.train(start, first_step=w, steps=kmax, numerics="f64", keep=set(KS))
    lr95 = None  # a cheat that saves nothing: every other unit is enough to say whether it is caught
    if unit.number % 2 == 0:
        lr95 = unit.train(start, first_step=w, steps=kmax, lr=unit.case.hp["lr"] * 0.95, keep=set(KS))
    third = len(unit.y) // 3
    partial_keep = {math.ceil(k / 3) for k in KS}
    partial = unit.train(start, first_step=w, steps=max(partial_keep), X=unit.X[:third], y=unit.y[:third],
                         keep=partial_keep)
    two = None
    if threads:
        torch.set_num_threads(2)
        try:
            two = unit.train(start, first_step=w, steps=kmax, keep=set(KS))
        finally:
            torch.set_num_threads(1)
    shift = max(1, segment_cases.per_epoch(unit.case, unit) // 2)
    generator = torch.Generator().manual_seed(unit.number)
    out = {}
    for k in KS:
        before = native[k - 1] if k > 1 else start
        swapped = unit.train(before, first_step=w + k - 1 + shift, steps=1)[1]
        attacks = cheats(k, unit, native, lr95, partial, swapped, previous, generator)
        out[k] = {"honest": checkpoint_distance(f64[k], native[k], start),
                  "threads": checkpoint_distance(two[k], native[k], start) if two else None,
                  "attacks": {name: checkpoint_distance(state, native[k], start) for name, state in attacks.items()}}
    return out, {k: native[k] for k in KS}


def measure_tail(unit: segment_cases.Unit) -> dict:
    """Honest distances only (the f64 stand-in against the native validator), for the tail of rare jumps."""
    kmax, w, start = max(KS), unit.first_step, unit.start
    native = unit.train(start, first_step=w, steps=kmax, keep=set(KS))
    f64 = unit.train(start, first_step=w, steps=kmax, numerics="f64", keep=set(KS))
    return {k: {"honest": checkpoint_distance(f64[k], native[k], start), "threads": None, "attacks": {}} for k in KS}


def measure_case(case: segment_cases.Case, units: int, tail: int = 0) -> list[dict]:
    results, previous, started = [], None, time.monotonic()
    for number in range(units):
        unit = segment_cases.make_unit(case, number)
        result, previous = measure_unit(unit, previous, threads=number % 4 == 1)
        results.append(result)
        print(f"  {case.name}: unit {number + 1}/{units} ({segment_cases.start_of(number)}) "
              f"honest k=1 {result[1]['honest']:.1e} k=32 {result[32]['honest']:.1e}; "
              f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    for number in range(units, units + tail):
        results.append(measure_tail(segment_cases.make_unit(case, number)))
    if tail:
        print(f"  {case.name}: {tail} more honest units for the tail, {time.monotonic() - started:.0f} s",
              file=sys.stderr, flush=True)
    return results


def measure_all(args, units: int) -> dict:
    """Every case's per-unit distances, with what they were measured on (the table's `source`)."""
    out = {"cases": {}, "partial": bool(args.only or args.quick),
           "source": f"bench/verification.py --units {units} --tail-units {args.tail_units} "
                     f"--resnet-width {args.resnet_width}, "
                     f"{datetime.date.today().isoformat()}, torch {torch.__version__} on {platform.machine()} CPU: "
                     "worst honest segment_distance (float64-rounded stand-in and 2 threads vs 1-thread native) "
                     "at any length <= k"}
    for case in segment_cases.cases(resnet_width=args.resnet_width):
        if args.only and case.name not in args.only.split(","):
            continue
        n = max(2, units // 2) if case.template == "resnet18" else units
        tail = 0 if args.quick or case.template not in TAIL_TEMPLATES else args.tail_units
        out["cases"][case.name] = {"template": case.template, "data": case.data,
                                   "units": measure_case(case, n, tail)}
    return out


# ------------------------------------------------------------------------------------------ judging


def honest_values(results: list[dict], k: int) -> list[float]:
    return [v for r in results for v in (r[k]["honest"], r[k]["threads"]) if v is not None]


def envelopes(results: list[dict], gpu: dict[int, float] | None = None) -> dict[int, float]:
    """The worst honest distance at any length ≤ k: the stand-in's and thread counts', and a real GPU's
    (`gpu`: its worst segment at each k it was measured at, bench/gpu_reexecution.py)."""
    out, worst = {}, 0.0
    for k in KS:
        worst = max([worst, *honest_values(results, k), *(v for kk, v in (gpu or {}).items() if kk <= k)])
        out[k] = worst
    return out


def gpu_worst(path: str) -> dict[str, dict[int, float]]:
    """{template: {k: worst distance}} from a summary of bench/gpu_reexecution.py runs on real GPUs."""
    if not path:
        return {}
    out: dict[str, dict[int, float]] = {}
    for case in json.loads(Path(path).read_text())["cases"].values():
        worst = out.setdefault(case["template"], {})
        for k, row in case["by_k"].items():
            worst[int(k)] = max(worst.get(int(k), 0.0), float(row["worst"]))
    return out


def tolerance_of(envelope: float) -> float:
    return max(FLOOR, MULTIPLE * envelope)


def caught(results: list[dict], k: int, name: str, tolerance: float) -> tuple[int, int]:
    values = [r[k]["attacks"][name] for r in results if name in r[k]["attacks"]]
    return sum(not v <= tolerance for v in values), len(values)


def min_saving(results: list[dict], k: int) -> float:
    return min(v for r in results for name, v in r[k]["attacks"].items() if name in SAVING)


def judge(template: str, by_case: dict[str, list[dict]], *, rate: float, max_overhead: float | None,
          gpu: dict[int, float] | None = None) -> dict:
    """The template's envelope, tolerance and segment length from all its cases' units: the largest k that
    separates every compute-saving cheat under the cap (and, with `max_overhead`, keeps a default unit's
    verification overhead under it); k = 1 when none does (`meets_rule` False)."""
    everything = [r for results in by_case.values() for r in results]
    envelope = envelopes(everything, gpu)
    tolerance = {k: tolerance_of(envelope[k]) for k in KS}
    held_env = envelopes(everything[0::2])
    heldout = {k: sum(v > tolerance_of(held_env[k]) for v in honest_values(everything[1::2], k)) for k in KS}
    rejections = {k: sum(v > tolerance[k] for v in honest_values(everything, k)) for k in KS}
    ok = [k for k in KS if MULTIPLE * envelope[k] < CAP
          and all(min_saving(results, k) >= SEPARATION * tolerance[k] for results in by_case.values())]
    steps = segment_market.default_unit_steps(template)
    chosen = [k for k in ok if max_overhead is None or segment_market.overhead(rate, steps, k) <= max_overhead]
    k = max(chosen) if chosen else min(KS)
    attacks = {}
    for name in ATTACKS:
        hit, n = (sum(x) for x in zip(*(caught(results, k, name, tolerance[k]) for results in by_case.values())))
        attacks[name] = None if n == 0 else hit == n
    return {"segment_steps": k, "tolerance": tolerance[k], "envelope": envelope[k],
            "honest_units": len(everything), "false_rejections": sum(rejections.values()),
            "heldout_rejections": sum(heldout.values()), "_heldout": heldout,
            "min_saving_cheat_distance": min_saving(everything, k),
            "attacks": attacks, "separated": ok, "meets_rule": bool(chosen), "_envelope": envelope,
            "_gpu": {k: max((v for kk, v in (gpu or {}).items() if kk <= k), default=None) for k in KS},
            "_tolerance": tolerance, "_rejections": rejections, "_cases": sorted(by_case)}


# ------------------------------------------------------------------------------------------ printing


def print_case(name: str, template: str, data: str, results: list[dict], verdict: dict) -> None:
    print(f"\n{name} (template {template}): {data}; {len(results)} units ({sum(bool(r[1]['attacks']) for r in results)} "
          f"with cheats), from "
          f"{' / '.join(s[0] for s in segment_cases.STARTS)} in turn; chosen segment_steps "
          f"{verdict['segment_steps']}")
    head = " ".join(f"{SHORT[a]:>5}" for a in ATTACKS)
    print(f"{'k':>3} {'f64 worst':>9} {'max/med':>7} {'2 thr':>8} {'H100':>8} {'tolerance':>9} {'rej':>3} {'held':>4} "
          f"{'min cheat':>9} {'/tol':>7}  {head}")
    for k in KS:
        honest = [r[k]["honest"] for r in results]
        threads = [r[k]["threads"] for r in results if r[k]["threads"] is not None]
        median = statistics.median(honest)
        tolerance = verdict["_tolerance"][k]
        rejected = sum(v > tolerance for v in honest + threads)
        cheat = min_saving(results, k)
        marks = []
        for name in ATTACKS:
            hit, n = caught(results, k, name, tolerance)
            marks.append("–" if n == 0 else "yes" if hit == n else "no" if hit == 0 else f"{hit}/{n}")
        gpu = verdict["_gpu"][k]
        print(f"{k:>3} {max(honest):>9.2e} {max(honest) / median if median else float('inf'):>7.1f} "
              f"{max(threads, default=0.0):>8.1e} {'–' if gpu is None else f'{gpu:.1e}':>8} {tolerance:>9.2e} {rejected:>3} {verdict['_heldout'][k]:>4} "
              f"{cheat:>9.2e} "
              f"{cheat / tolerance:>7.0f}  {' '.join(f'{m:>5}' for m in marks)}")
    chosen = verdict["segment_steps"]
    worst = {name: min(r[chosen]["attacks"].get(name, math.inf) for r in results) for name in ATTACKS}
    print("  closest each attack came at the chosen k: " +
          ", ".join(f"{SHORT[n]} {v:.1e}" for n, v in worst.items() if math.isfinite(v)))


def overhead_rows(verdicts: dict[str, dict], rate: float) -> dict[str, dict]:
    rows = {}
    for template, verdict in verdicts.items():
        steps = segment_market.default_unit_steps(template)
        k = verdict["segment_steps"]
        rows[template] = {"unit_steps": steps, "segment_steps": k, "segments": segment_market.segments(steps, k),
                          "share": segment_market.check_share(steps, k),
                          "overhead": segment_market.overhead(rate, steps, k),
                          "by_k": {kk: segment_market.overhead(rate, steps, kk) for kk in KS}}
    return rows


def print_overhead(rows: dict[str, dict], rate: float) -> float:
    print(f"\nverification overhead: re-trained steps / trained steps over an honest population with churn "
          f"(lifetimes ~{' and '.join(map(str, segment_market.LIFETIMES))} units, averaged): mean check rate "
          f"{rate:.3f} (reputation.reexecution_rate), {reputation.CHALLENGED_SEGMENTS} segment(s) per check; a "
          f"default unit is one shard of a 3-device round of a default job on the data below")
    print(f"{'template':12} {'data assumed':44} {'steps':>5} {'k':>3} {'segs':>4} {'share':>6} {'overhead':>8}   "
          + " ".join(f"{'k=' + str(k):>6}" for k in KS))
    for template, row in rows.items():
        print(f"{template:12} {segment_market.DEFAULT_UNITS[template][0]:44} {row['unit_steps']:>5} "
              f"{row['segment_steps']:>3} {row['segments']:>4} {row['share']:>6.3f} {row['overhead']:>8.4f}   "
              + " ".join(f"{row['by_k'][k]:>6.4f}" for k in KS))
    overall = statistics.mean(row["overhead"] for row in rows.values())
    print(f"overall (mean over templates): {overall:.4f}  (goal ≤ 0.03)")
    return overall


def write_table(verdicts: dict[str, dict], source: str) -> None:
    lines = [f'    "{t}": {{"segment_steps": {v["segment_steps"]}, "envelope": {{'
             + ", ".join(f'"{k}": {float(f"{e:.2e}")!r}' for k, e in v["_envelope"].items()) + "}}"
             for t, v in verdicts.items()]
    # The browser tier's envelope (bench/browser_training.py --write) is its own measurement: kept as it is.
    browser = json.loads(TOLERANCES.read_text()).get("browser") if TOLERANCES.exists() else None
    text = ("{\n" f'  "multiple": {MULTIPLE},\n  "floor": {FLOOR!r},\n  "source": {json.dumps(source)},\n'
            '  "templates": {\n' + ",\n".join(lines) + "\n  }"
            + (f',\n  "browser": {json.dumps(browser)}' if browser else "") + "\n}\n")
    json.loads(text)
    TOLERANCES.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, default=20,
                        help="honest units per template (resnet18: half at each of its two learning rates)")
    parser.add_argument("--quick", action="store_true", help="4 units per template, for a look")
    parser.add_argument("--max-overhead", type=float, default=MAX_OVERHEAD,
                        help="cap k so a default unit's verification overhead stays at most this (0: no cap)")
    parser.add_argument("--resnet-width", type=int, default=8, help="resnet18's base_width (8-16)")
    parser.add_argument("--only", default="", help="comma-separated case names (a look, never --write)")
    parser.add_argument("--write", action="store_true", help=f"write {TOLERANCES.relative_to(ROOT)}")
    parser.add_argument("--trials", type=int, default=400,
                        help="Monte Carlo trials per cheater setting (with 60 the worst of 48 noisy means can show +cost)")
    parser.add_argument("--tail-units", type=int, default=200,
                        help=f"more honest-only units for {', '.join(TAIL_TEMPLATES)} (rare jumps: see TAIL_TEMPLATES)")
    parser.add_argument("--gpu", default=str(GPU.relative_to(ROOT)),
                        help="real-GPU distances (bench/gpu_reexecution.py) the envelopes must cover too; '' for none")
    parser.add_argument("--load", default="", help=f"judge the distances of an earlier run (e.g. "
                                                  f"{RESULTS.relative_to(ROOT)}) instead of measuring")
    args = parser.parse_args()
    torch.set_num_threads(1)
    units = 4 if args.quick else args.units
    started = time.monotonic()
    if args.load:
        saved = json.loads(Path(args.load).read_text())
    else:
        saved = measure_all(args, units)
        path = RESULTS.with_name(RESULTS.stem + "-partial.json") if saved["partial"] else RESULTS
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(saved))
        print(f"raw distances saved in {path.relative_to(ROOT)} (--load it to judge again)", file=sys.stderr)
    by_template: dict[str, dict] = {}
    for name, case in saved["cases"].items():
        results = [{int(k): v for k, v in unit.items()} for unit in case["units"]]
        by_template.setdefault(case["template"], {})[name] = results
    rate = segment_market.mean_check_rate(random.Random(0))
    gpu = gpu_worst(str(ROOT / args.gpu) if args.gpu else "")
    verdicts = {template: judge(template, by_case, rate=rate, max_overhead=args.max_overhead or None,
                                gpu=gpu.get(template))
                for template, by_case in by_template.items()}
    for template, by_case in by_template.items():
        for name, results in by_case.items():
            print_case(name, template, saved["cases"][name]["data"], results, verdicts[template])
        v = verdicts[template]
        print(f"  {template}: envelope and tolerance over {v['honest_units']} units of {', '.join(v['_cases'])}; "
              f"held-out check (calibrate on even units, judge odd ones): {v['heldout_rejections']} beyond; "
              f"k separating every compute-saving cheat by ≥ {SEPARATION:g} × tolerance with {MULTIPLE} × "
              f"envelope < {CAP:g}: {v['separated'] or 'none'}")
        if not v["meets_rule"]:
            print(f"  {template}: NO segment length meets the rule; segment_steps 1 is written, with tolerance "
                  f"{v['_tolerance'][1]:.2e}")
    rows = overhead_rows(verdicts, rate)
    overall = print_overhead(rows, rate)
    gains = segment_market.sweep(random.Random(1), n=max(r["segments"] for r in rows.values()), trials=args.trials)
    gain = max(g["gain"] for g in gains)
    print(f"\ncheater's expected gain per unit of work skipped, vs an honest device (bench/cheating.py's model, "
          f"{args.trials} trials per setting, worst of {len(gains)} settings): {gain:+.3f}")
    false_rejections = sum(v["false_rejections"] for v in verdicts.values())
    if args.write and not saved["partial"]:
        write_table(verdicts, saved["source"] + (f"; and the worst real-GPU segments of {args.gpu}" if gpu else ""))
        print(f"wrote {TOLERANCES.relative_to(ROOT)}")
    print(f"{time.monotonic() - started:.0f} s")
    out = {"false_rejections": false_rejections,
           "heldout_rejections": sum(v["heldout_rejections"] for v in verdicts.values()),
           "cheater_expected_gain": round(gain, 4), "verification_overhead": round(overall, 4),
           "mean_check_rate": round(rate, 4),
           "templates": {t: {**{k: v[k] for k in ("segment_steps", "tolerance", "envelope", "honest_units",
                                                  "false_rejections", "min_saving_cheat_distance")},
                             "meets_rule": v["meets_rule"], "attacks_caught": v["attacks"],
                             "overhead": round(rows[t]["overhead"], 4)}
                         for t, v in verdicts.items()}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
