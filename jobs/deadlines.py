"""Round deadlines from the plan and the arrivals seen so far: pure arithmetic over seconds.

A round's units are sized so that their devices finish together, and each unit carries the seconds its
planned device should take (`expected`, from the device's FLOP/s). Probe benchmarks flatter or slander real
work, so the plan alone is trusted only loosely; once results arrive, their pace (elapsed / expected) says
how far off the plan is, and the outstanding units are expected to keep that pace.

The soft deadline is when an outstanding unit counts as a straggler and is issued again to a free device;
the hard one, twice as far from the opening, is when the round closes with the verified updates it has.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import NamedTuple

PLAN_SLACK = 3.0  # before any arrival: the plan's seconds may be this far off before a unit is a straggler
ARRIVAL_SLACK = 1.5  # after arrivals: an outstanding unit may run this much longer than its predicted finish


class Arrival(NamedTuple):
    elapsed: float  # seconds from the round's opening to the result's arrival
    expected: float  # the unit's planned seconds; 0 when its device's speed was unknown


class Deadlines(NamedTuple):
    soft: float  # seconds after opening: stragglers are re-issued
    hard: float  # seconds after opening: the round closes with what it has (at least one verified update)


def round_deadlines(*, outstanding: Sequence[float], arrivals: Sequence[Arrival], grace: float, floor: float,
                    ceiling: float) -> Deadlines:
    """Deadlines for a round whose outstanding units have these planned seconds (0: unknown), given the
    arrivals so far. `grace` covers transfers and checks; the soft deadline stays within [floor, ceiling].

    - No arrival yet: the slowest outstanding unit's plan × PLAN_SLACK (the ceiling when nothing is known).
    - Arrivals: the outstanding units are predicted at the median pace of the arrivals (elapsed / expected);
      without planned seconds, at the latest arrival's time. The deadline gives that prediction
      ARRIVAL_SLACK, and never falls before the latest arrival seen (the round is at least that slow).
    """
    planned = [s for s in outstanding if s > 0]
    if not arrivals:
        soft = max(planned) * PLAN_SLACK + grace if planned and len(planned) == len(outstanding) else ceiling
    else:
        latest = max(a.elapsed for a in arrivals)
        paces = [a.elapsed / a.expected for a in arrivals if a.expected > 0]
        if paces and planned:
            predicted = max(max(planned) * statistics.median(paces), latest)
        else:
            predicted = latest
        soft = predicted * ARRIVAL_SLACK + grace
    soft = min(max(soft, floor), ceiling)
    return Deadlines(soft, 2 * soft)


def expected_seconds(flops: int, flops_per_s: float) -> float:
    """How long a unit of `flops` should take a device of this measured speed; 0 when the speed is unknown."""
    return flops / flops_per_s if flops_per_s > 0 else 0.0
