"""The economics of segment checks, shared by bench/verification.py and bench/cheating.py: pure arithmetic
and a Monte Carlo market run with Muninn's own reputation rules (contributors.reputation).

Units and segments. A unit of T optimizer steps is cut into n = ceil(T / k) segments of k steps. A checked
unit (probability reputation.reexecution_rate(streak)) has m = min(CHALLENGED_SEGMENTS, n) segments re-trained,
drawn uniformly, so the validator re-trains m x T / n steps on average: a share m / n of the unit.

The default units (`DEFAULT_UNITS`) are one shard of a 3-device round of a default job on data of a typical
size for the template, after the 20 % holdout; they are assumptions, stated there.
"""
from __future__ import annotations

import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "platform", ROOT / "worker_client"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from contributors import reputation  # noqa: E402

ROUND_DEVICES = 3
HOLDOUT = 0.2
# template: (the data assumed, training samples before the holdout, default epochs, default batch size)
DEFAULT_UNITS = {
    "mlp": ("scikit-learn digits, 1797 rows", 1797, 2, 32),
    "cnn": ("scikit-learn digits as 8x8 images, 1797", 1797, 2, 32),
    "resnet18": ("a CIFAR-10-sized zip, 50 000 images", 50_000, 1, 64),
    "transformer": ("1 MB of text, byte tokens, windows of 64", (1_000_000 - 1) // 64, 1, 32),
    "lora": ("1 MB of text, byte tokens, windows of 64", (1_000_000 - 1) // 64, 1, 32),
}
LIFETIMES = (200, 1000)  # honest devices live ~this many units (exponential): a population with churn


def default_unit_steps(template: str) -> int:
    _, rows, epochs, batch = DEFAULT_UNITS[template]
    train = rows - min(rows - 1, max(1, round(rows * HOLDOUT)))
    shard = math.ceil(train / ROUND_DEVICES)
    return epochs * math.ceil(shard / batch)


def segments(steps: int, k: int) -> int:
    return max(1, math.ceil(steps / k))


def challenged(n: int, per_check: int | None = None) -> int:
    return min(reputation.CHALLENGED_SEGMENTS if per_check is None else per_check, n)


def check_share(steps: int, k: int) -> float:
    """The share of a checked unit's steps the validator re-trains: m / n."""
    n = segments(steps, k)
    return challenged(n) / n


def mean_check_rate(rng: random.Random, *, devices: int = 2000, lifetimes: tuple[int, ...] = LIFETIMES,
                    min_rate: float = reputation.MIN_RATE) -> float:
    """Checked units / all units of an honest population with churn: each device lives an exponential number
    of units (mean `lifetime`), starting with streak 0 and never failing; averaged over `lifetimes`."""
    rates = []
    for lifetime in lifetimes:
        units = checked = 0.0
        for _ in range(devices):
            for streak in range(max(1, int(rng.expovariate(1 / lifetime)))):
                units += 1
                checked += reputation.reexecution_rate(streak, min_rate=min_rate)
        rates.append(checked / units)
    return sum(rates) / len(rates)


def overhead(rate: float, steps: int, k: int) -> float:
    """Re-trained steps / trained steps: the check rate times the share of a checked unit re-trained."""
    return rate * check_share(steps, k)


def catch_probability(share: float, n: int, per_check: int | None = None) -> float:
    """A checked unit whose cheat skipped a share `share` of its n segments: 1 - (1 - s)^m."""
    return 1 - (1 - share) ** challenged(n, per_check)


def cheater_income(rng: random.Random, *, horizon: int, cheat_share: float, segment_share: float, n: int,
                   warmup: int, cost: float, holding: int, per_check: int | None = None,
                   min_rate: float = reputation.MIN_RATE, quarantine_after: int = reputation.QUARANTINE_AFTER,
                   hold_after: int | None = reputation.HOLD_AFTER) -> tuple[float, float]:
    """(net income, units of work skipped) of one cheater over `horizon` units.

    Every unit pays 1 and costs an honest device `cost`. After `warmup` honest units, the cheater cheats on a
    share `cheat_share` of its units, skipping the work of a share `segment_share` of their segments (saving
    segment_share x cost each). A checked cheat is caught with `catch_probability`; a caught unit earns nothing,
    resets the streak and counts a confirmed failure. From reputation.HOLD_AFTER failures on, each one holds the
    pay of its unverified pending units (the last `holding` units' that no check passed, not yet cleared) for
    review; after reputation.QUARANTINE_AFTER failures the device is quarantined, which holds them too. We
    assume staff forfeit held pay of a device with confirmed failures. A quarantined device comes back as a new
    one (streak 0) and works honestly for `warmup` units again. `per_check`, `min_rate`, `quarantine_after` and
    `hold_after` (None: never before quarantine) replace the site's rules (to see what each one is worth)."""
    income, skipped, streak, failures, done, honest_until = 0.0, 0.0, 0, 0, 0, warmup
    pending: list[tuple[float, bool]] = []  # (pay, passed a check)
    while done < horizon:
        done += 1
        cheat = done > honest_until and rng.random() < cheat_share
        checked = rng.random() < reputation.reexecution_rate(streak, min_rate=min_rate)
        income -= cost * (1 - segment_share if cheat else 1)
        caught = cheat and checked and rng.random() < catch_probability(segment_share, n, per_check)
        if cheat:
            skipped += segment_share
        if caught:
            streak, failures, pay = 0, failures + 1, 0.0
            quarantined = reputation.quarantine_due(failures, limit=quarantine_after)
            if quarantined or (hold_after is not None and reputation.hold_due(failures, limit=hold_after)):
                pending = [p for p in pending if p[1]]  # unverified pay held, and forfeited
            if quarantined:
                streak, failures, honest_until = 0, 0, done + warmup  # a new device, a new warm-up
        else:
            streak, pay = streak + 1, 1.0
        pending.append((pay, checked and not caught))
        if len(pending) > holding:
            income += pending.pop(0)[0]  # cleared
    return income + sum(p for p, _ in pending), skipped  # still pending at the end: paid as well


CHEAT_SHARES = (0.05, 0.2, 0.5, 1.0)
WARMUPS = (0, 50, 500)


def segment_shares(n: int) -> tuple[float, ...]:
    """The shares of a unit's segments a cheater skips: one segment, a quarter, half, all."""
    return tuple(sorted({1 / n, 0.25, 0.5, 1.0}))


def sweep(rng: random.Random, *, n: int, trials: int, horizon: int = 2000, cost: float = 0.3,
          holding: int = 50, settings: list[tuple[float, float, int]] | None = None, **rules) -> list[dict]:
    """Every (cheat share, segment share, warm-up): the cheater's mean income and its gain over an honest
    device's (horizon × (1 - cost)) per unit of work skipped."""
    honest = horizon * (1 - cost)
    if settings is None:
        settings = [(c, s, w) for c in CHEAT_SHARES for s in segment_shares(n) for w in WARMUPS]
    rows = []
    for cheat_share, segment_share, warmup in settings:
        runs = [cheater_income(rng, horizon=horizon, cheat_share=cheat_share, segment_share=segment_share, n=n,
                               warmup=warmup, cost=cost, holding=holding, **rules) for _ in range(trials)]
        income = sum(r[0] for r in runs) / trials
        skipped = sum(r[1] for r in runs) / trials
        rows.append({"cheat_share": cheat_share, "segment_share": segment_share, "warmup": warmup,
                     "skipped": skipped, "income": income, "vs_honest": income - honest,
                     "gain": (income - honest) / skipped if skipped else 0.0})
    return rows
