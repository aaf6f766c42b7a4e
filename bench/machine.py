"""The machine's speed, for comparing benchmark runs taken at different times.

The dev VM's speed swings by up to 2.5x from hour to hour (other tenants on the same host), so a figure from one
hour cannot be compared with a figure from another. `yardstick_s` times a fixed piece of pure-Python work, best
of five, before a benchmark starts its stack: the earlier READMEs' `sum(range(10**7))` (0.13-0.15 s in this VM's
fast hours, 0.30-0.37 s in its slow ones). Each benchmark prints it and puts it in its last JSON line."""
from __future__ import annotations

import time

WORK = 10**7


def yardstick_s(repeats: int = 5) -> float:
    """Seconds (wall clock, best of `repeats`) to sum range(10**7) on one core of this machine now."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        sum(range(WORK))
        best = min(best, time.perf_counter() - start)
    return round(best, 3)
