"""Does cheating pay under segment checks? A Monte Carlo market run with Muninn's own reputation rules
(bench/segment_market.py), plus a quick honest check of false rejections at mlp's segment length.

Model: every unit pays the contributor 1 and costs an honest device `cost` to compute; a unit has n segments.
A cheater works honestly for a warm-up, then on a share of its units skips the work of a share s of their
segments (saving s × cost). A checked unit (reputation.reexecution_rate(streak)) has
m = min(CHALLENGED_SEGMENTS, n) segments re-trained, drawn unpredictably: the cheat is caught with probability
1 - (1 - s)^m (bench/verification.py shows that a re-trained segment whose work was skipped always lands far
outside the tolerance). A caught unit earns nothing, resets the streak and counts a confirmed failure, which
holds the pay of its unverified pending units (the last `holding` units' that no check passed, not yet
cleared) for review (HOLD_AFTER); after QUARANTINE_AFTER failures on distinct units the device is quarantined.
We assume staff forfeit held pay of a device with confirmed failures. It comes back as a new device (streak 0) after another
warm-up. What is still pending at the end of the horizon is paid. We compare its income with an honest
device's over the same horizon, per unit of work skipped (negative: cheating loses money).

n is the most segments any template's default unit has at its segment length (contributors/data/
tolerances.json, bench/segment_market.py's DEFAULT_UNITS): one segment is then the smallest share a cheat can
skip. When a setting pays, the bench says so and re-runs the paying settings with more challenged segments
per check and with a higher minimum check rate, and says what each would cost in verification overhead.

    .venv/bin/python bench/cheating.py [--trials 400] [--horizon 2000]

Last line: JSON with cheater_expected_gain (the worst setting), verification_overhead, false_rejections.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform"), str(ROOT / "worker_client"), str(ROOT / "bench")]

import segment_market  # noqa: E402

from contributors import reputation, tolerances  # noqa: E402
from contributors.checks import checkpoint_distance  # noqa: E402

FIX_CHALLENGED = (2, 4, 8, 16)
FIX_MIN_RATE = (0.1, 0.2, 0.3, 0.5)


def default_segments() -> dict[str, int]:
    return {t: segment_market.segments(segment_market.default_unit_steps(t), tolerances.segment_steps(t))
            for t in segment_market.DEFAULT_UNITS}


def overall_overhead(rate: float, *, per_check: int | None = None) -> float:
    """The mean over templates of re-trained / trained steps at the table's segment lengths."""
    shares = []
    for template in segment_market.DEFAULT_UNITS:
        steps = segment_market.default_unit_steps(template)
        n = segment_market.segments(steps, tolerances.segment_steps(template))
        shares.append(rate * segment_market.challenged(n, per_check) / n)
    return statistics.mean(shares)


def false_rejections(units: int) -> tuple[int, int, float, int]:
    """mlp units at its segment length: the native 1-thread validator against the same segment on 2 threads
    and under numerics="f64". (rejected, segments compared, worst distance, k)."""
    import segment_cases

    case = segment_cases.mlp()
    k = tolerances.segment_steps("mlp")
    tolerance = tolerances.tolerance("mlp", k)
    rejected = compared = 0
    worst = 0.0
    for number in range(units):
        unit = segment_cases.make_unit(case, number)
        validator = unit.train(unit.start, first_step=unit.first_step, steps=k)[k]
        torch.set_num_threads(2)
        try:
            devices = [unit.train(unit.start, first_step=unit.first_step, steps=k)[k]]
        finally:
            torch.set_num_threads(1)
        devices.append(unit.train(unit.start, first_step=unit.first_step, steps=k, numerics="f64")[k])
        for device in devices:
            d = checkpoint_distance(device, validator, unit.start)
            worst, compared, rejected = max(worst, d), compared + 1, rejected + (d > tolerance)
    return rejected, compared, worst, k


def print_rows(rows: list[dict]) -> None:
    print(f"{'cheat share':>11} {'segments skipped':>16} {'warm-up':>8} {'work skipped':>12} {'net income':>11} "
          f"{'vs honest':>10} {'gain/skip':>10}")
    for r in rows:
        print(f"{r['cheat_share']:>11.2f} {r['segment_share']:>16.3f} {r['warmup']:>8d} {r['skipped']:>12.1f} "
              f"{r['income']:>11.1f} {r['vs_honest']:>+10.1f} {r['gain']:>+10.3f}")


def fixes(rng: random.Random, paying: list[dict], *, n: int, args) -> None:
    """Re-run the settings that pay with more segments per check, then with a higher minimum rate."""
    settings = [(r["cheat_share"], r["segment_share"], r["warmup"]) for r in paying]
    common = {"n": n, "trials": args.trials, "horizon": args.horizon, "cost": args.cost, "holding": args.holding,
              "settings": settings}
    print(f"\n{len(paying)} setting(s) pay. Re-run with more challenged segments per checked unit "
          f"(CHALLENGED_SEGMENTS, now {reputation.CHALLENGED_SEGMENTS}) or a higher floor on the check rate "
          f"(MIN_RATE, now {reputation.MIN_RATE}):")
    base_rate = segment_market.mean_check_rate(random.Random(0))
    for per_check in FIX_CHALLENGED:
        worst = max(r["gain"] for r in segment_market.sweep(rng, per_check=per_check, **common))
        print(f"  CHALLENGED_SEGMENTS = {per_check:>2}: worst gain/skip {worst:+.3f}; verification overhead "
              f"{overall_overhead(base_rate, per_check=per_check):.4f}")
    for min_rate in FIX_MIN_RATE:
        worst = max(r["gain"] for r in segment_market.sweep(rng, min_rate=min_rate, **common))
        rate = segment_market.mean_check_rate(random.Random(0), min_rate=min_rate)
        print(f"  MIN_RATE = {min_rate:.2f}: worst gain/skip {worst:+.3f}; verification overhead "
              f"{overall_overhead(rate):.4f}")
    worst = max(r["gain"] for r in segment_market.sweep(rng, hold_after=None, **common))
    print(f"  (for comparison, without holding unverified pay at a device's first confirmed failure (HOLD_AFTER, now "
          f"{reputation.HOLD_AFTER}), only at quarantine: worst gain/skip {worst:+.3f})")
    longer = segment_market.sweep(rng, **{**common, "horizon": 10 * args.horizon,
                                          "trials": max(20, args.trials // 10)})
    print(f"  (unchanged rules over a 10x longer horizon, {10 * args.horizon} units: worst gain/skip "
          f"{max(r['gain'] for r in longer):+.3f})")
    print(f"Why: a cheat skipping a share s of a unit's segments saves s x cost; when its unit is checked it is "
          f"caught with probability about m x s and loses that unit's pay (1). So it pays while check rate x m < "
          f"cost ({reputation.MIN_RATE} x {reputation.CHALLENGED_SEGMENTS} < {args.cost} for a trusted device), "
          f"unless it is caught {reputation.QUARANTINE_AFTER} times and quarantined, which a rare or small cheat "
          f"seldom is.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=400)
    parser.add_argument("--horizon", type=int, default=2000)
    parser.add_argument("--cost", type=float, default=0.3, help="compute cost of a unit, as a share of its pay")
    parser.add_argument("--holding", type=int, default=50, help="units of pay still pending (forfeitable)")
    parser.add_argument("--honest-units", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    started = time.monotonic()
    by_template = default_segments()
    n = max(by_template.values())
    print(f"segments per default unit: {by_template}; the sweep uses n = {n}, {args.trials} trials of "
          f"{args.horizon} units per setting, cost {args.cost}, {args.holding} units of pay pending\n")
    rows = segment_market.sweep(rng, n=n, trials=args.trials, horizon=args.horizon, cost=args.cost,
                                holding=args.holding)
    print_rows(rows)
    gain = max(r["gain"] for r in rows)
    paying = [r for r in rows if r["gain"] >= 0]
    if paying:
        fixes(rng, paying, n=n, args=args)
    rate = segment_market.mean_check_rate(random.Random(0))  # the same population as bench/verification.py's
    overhead = overall_overhead(rate)
    rejected, compared, worst, k = false_rejections(args.honest_units)
    print(f"\nhonest income over {args.horizon} units: {args.horizon * (1 - args.cost):.0f}; worst cheater gain per "
          f"unit of work skipped: {gain:+.3f} ({'cheating pays in some settings' if gain >= 0 else 'never pays'})")
    print(f"verification overhead (honest population with churn, mean check rate {rate:.3f}, mean over templates): "
          f"{overhead:.4f}")
    print(f"honest mlp segments of k = {k} on 2 threads and under f64 vs the 1-thread validator: {rejected}/{compared} "
          f"beyond tolerance {tolerances.tolerance('mlp', k):.2g} (worst distance {worst:.2e}); "
          f"{time.monotonic() - started:.0f} s")
    print(json.dumps({"cheater_expected_gain": round(gain, 4), "verification_overhead": round(overhead, 4),
                      "false_rejections": rejected, "honest_segments": compared, "worst_honest_distance": worst,
                      "mlp_segment_steps": k, "tolerance": tolerances.tolerance("mlp", k), "segments": n,
                      "paying_settings": len(paying)}))


if __name__ == "__main__":
    main()
