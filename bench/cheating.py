"""Does cheating pay? A Monte Carlo market run with Muninn's own reputation rules, plus a measurement of
honest re-execution distances across thread counts (false rejections).

Model: every unit pays the contributor 1 (its share) and costs an honest device `cost` to compute.
A cheater builds a streak honestly, then skips the work on a share of its units (saving `cost` each).
Each result is re-executed with `reputation.reexecution_rate(streak)`; a caught cheat earns nothing,
resets the streak and counts as a failure; `reputation.QUARANTINE_AFTER` failures quarantine the device
and forfeit its pending earnings (the last `holding` units' pay, not yet cleared). A quarantined cheater
comes back as a new device (streak 0). We compare its net income with an honest device's over the same
horizon, per unit of work it skipped.

    .venv/bin/python bench/cheating.py [--trials 400] [--horizon 2000]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform"), str(ROOT / "worker_client")]
from contributors import reputation  # noqa: E402
from contributors.checks import reexecution_distance  # noqa: E402

TOLERANCE = 1e-3  # settings.MUNINN_REEXECUTION_TOLERANCE


def cheater_income(rng: random.Random, *, horizon: int, cheat_share: float, warmup: int, cost: float,
                   holding: int) -> tuple[float, int]:
    """(net income, units skipped) of one cheater over `horizon` units."""
    income, skipped, streak, failures, done, honest_until = 0.0, 0, 0, 0, 0, warmup
    pending: list[float] = []  # pay of the last `holding` units, forfeitable
    while done < horizon:
        done += 1
        cheat = done > honest_until and rng.random() < cheat_share
        checked = rng.random() < reputation.reexecution_rate(streak)
        if cheat:
            skipped += 1
        else:
            income -= cost
        if cheat and checked:
            streak, failures = 0, failures + 1
            pay = 0.0
            if reputation.quarantine_due(failures):
                pending.clear()  # forfeited
                streak, failures, honest_until = 0, 0, done + warmup  # a new device, a new warm-up
        else:
            streak += 1
            pay = 1.0
        pending.append(pay)
        if len(pending) > holding:
            income += pending.pop(0)  # cleared: paid out
    return income + sum(pending), skipped  # what is still pending at the end is paid as well


def honest_overhead(rng: random.Random, *, devices: int, lifetime: float) -> float:
    """Re-executions / all compute in an honest population with churn (devices live ~`lifetime` units)."""
    units = reexecuted = 0
    for _ in range(devices):
        streak = 0
        for _ in range(max(1, int(rng.expovariate(1 / lifetime)))):
            units += 1
            if rng.random() < reputation.reexecution_rate(streak):
                reexecuted += 1
            streak += 1
    return reexecuted / (units + reexecuted)


def false_rejections(runs: int) -> tuple[int, float]:
    """Train the same units on 1 and 2 threads; how many re-executions would disagree beyond the tolerance."""
    import torch
    from muninn_worker import training, zoo
    from sklearn.datasets import load_digits

    digits = load_digits()
    X_all = torch.tensor(digits.data, dtype=torch.float32)
    y_all = torch.tensor(digits.target)
    worst, rejected = 0.0, 0
    for run in range(runs):
        config = {"in_features": 64, "num_classes": 10, "hidden": [128] if run % 2 else [512, 256]}
        idx = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(run))[:300]
        X, y = X_all[idx], y_all[idx]
        base = zoo.init_state("mlp", config, run)
        std = X.std(0)
        base["norm_mean"], base["norm_std"] = X.mean(0), torch.where(std > 1e-6, std, torch.ones_like(std))
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            model = zoo.build_model("mlp", config)
            model.load_state_dict(base)
            results.append(training.train_local(model, X, y, epochs=2, batch_size=32, lr=0.05, momentum=0.9,
                                                seed=run).state_dict)
        distance = reexecution_distance(results[0], results[1], base)
        worst = max(worst, distance)
        rejected += distance > TOLERANCE
    return rejected, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=400)
    parser.add_argument("--horizon", type=int, default=2000)
    parser.add_argument("--cost", type=float, default=0.3, help="compute cost of a unit, as a share of its pay")
    parser.add_argument("--holding", type=int, default=50, help="units of pay still pending (forfeitable)")
    parser.add_argument("--honest-runs", type=int, default=40)
    args = parser.parse_args()
    rng = random.Random(0)
    started = time.monotonic()
    honest_income = args.horizon * (1 - args.cost)

    print(f"{'cheat share':>11} {'warm-up':>8} {'skipped':>8} {'net income':>11} {'vs honest':>10} {'gain/skip':>10}")
    gains = []
    for cheat_share in (0.05, 0.2, 0.5, 1.0):
        for warmup in (0, 50, 500):
            runs = [cheater_income(rng, horizon=args.horizon, cheat_share=cheat_share, warmup=warmup,
                                   cost=args.cost, holding=args.holding) for _ in range(args.trials)]
            income, skipped = mean(r[0] for r in runs), mean(r[1] for r in runs)
            gain = (income - honest_income) / skipped if skipped else 0.0
            gains.append(gain)
            print(f"{cheat_share:>11.2f} {warmup:>8d} {skipped:>8.0f} {income:>11.1f} {income - honest_income:>+10.1f}"
                  f" {gain:>+10.3f}")
    overhead = mean(honest_overhead(rng, devices=500, lifetime=lifetime) for lifetime in (200, 1000))
    rejected, worst = false_rejections(args.honest_runs)
    print(f"\nhonest income over {args.horizon} units: {honest_income:.0f}; verification overhead (honest "
          f"population with churn): {overhead:.1%}")
    print(f"honest re-executions on 1 vs 2 threads: {rejected}/{args.honest_runs} beyond tolerance {TOLERANCE:g} "
          f"(worst distance {worst:.2e}); {time.monotonic() - started:.0f} s")
    print(json.dumps({"cheater_expected_gain": round(max(gains), 4), "verification_overhead": round(overhead, 4),
                      "false_rejections": rejected, "honest_runs": args.honest_runs,
                      "worst_honest_distance": worst, "tolerance": TOLERANCE}))


if __name__ == "__main__":
    main()
