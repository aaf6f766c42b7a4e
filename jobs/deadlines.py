"""Round deadlines from the plan and the arrivals seen so far: pure arithmetic over seconds.

A round's units are sized so that their devices finish together, and each unit carries the seconds its
planned device should take (`expected`, from the device's FLOP/s). Probe benchmarks flatter or slander real
work, so the plan alone is trusted only loosely; once results arrive, their pace (elapsed / expected) says
how far off the plan is, and the round is expected to keep that pace.

The soft deadline is when an outstanding unit counts as a straggler and is issued again to a free device;
the hard one, twice as far from the opening, is when the round closes with the verified updates it has.

Every result that arrives moves the deadlines, so what they need is kept as a running statistic that one
arrival updates in constant time (`Arrivals.add`), whatever the number of units: the plan's slowest unit
(fixed when the round opens), how many results arrived, the latest, and the paces as a histogram of
log-spaced buckets, whose median is the pace's median to within half a bucket (PACE_BUCKETS_PER_DOUBLING).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

PLAN_SLACK = 3.0  # before any arrival: the plan's seconds may be this far off before a unit is a straggler
ARRIVAL_SLACK = 1.5  # after arrivals: an outstanding unit may run this much longer than its predicted finish
PACE_BUCKETS_PER_DOUBLING = 16  # a pace is kept to within 2^(1/32) ≈ 2.2 %
PACE_DOUBLINGS = 16  # paces beyond 2^±16 (a result 65,536 times faster or slower than planned) are clamped
PACE_ERROR = 2 ** (0.5 / PACE_BUCKETS_PER_DOUBLING) - 1  # the most a kept pace is off, relatively


class Arrival(NamedTuple):
    elapsed: float  # seconds from the round's opening to the result's arrival
    expected: float  # the unit's planned seconds; 0 when its device's speed was unknown


class Deadlines(NamedTuple):
    soft: float  # seconds after opening: stragglers are re-issued
    hard: float  # seconds after opening: the round closes with what it has (at least one verified update)


class Plan(NamedTuple):
    slowest: float  # the largest planned seconds of the round's units (0: none has a plan)
    complete: bool  # every unit has planned seconds (a device of unknown speed leaves the plan incomplete)


def plan_of(expected: Iterable[float]) -> Plan:
    """The plan of a round whose units have these planned seconds (0: unknown)."""
    seconds = list(expected)
    return Plan(max((s for s in seconds if s > 0), default=0.0), bool(seconds) and all(s > 0 for s in seconds))


def pace_bucket(elapsed: float, expected: float) -> int:
    """The histogram bucket of one arrival's pace (elapsed / expected; the plan must be known)."""
    pace = max(elapsed, 0.0) / expected
    if pace <= 0:
        return -PACE_DOUBLINGS * PACE_BUCKETS_PER_DOUBLING
    bucket = math.floor(math.log2(pace) * PACE_BUCKETS_PER_DOUBLING)
    return min(max(bucket, -PACE_DOUBLINGS * PACE_BUCKETS_PER_DOUBLING), PACE_DOUBLINGS * PACE_BUCKETS_PER_DOUBLING - 1)


def bucket_pace(bucket: int) -> float:
    """A bucket's pace: the geometric middle of the paces it holds."""
    return 2 ** ((bucket + 0.5) / PACE_BUCKETS_PER_DOUBLING)


class Arrivals(NamedTuple):
    """The results that arrived so far, as much as the deadlines need of them. `paces` maps a bucket
    (pace_bucket) to its count of arrivals, for those whose unit had planned seconds."""

    count: int = 0
    latest: float = 0.0
    paces: Mapping[int, int] = {}

    def add(self, arrival: Arrival) -> Arrivals:
        paces = dict(self.paces)
        if arrival.expected > 0:
            bucket = pace_bucket(arrival.elapsed, arrival.expected)
            paces[bucket] = paces.get(bucket, 0) + 1
        return Arrivals(self.count + 1, max(self.latest, arrival.elapsed) if self.count else arrival.elapsed, paces)

    def median_pace(self) -> float | None:
        """The median pace (the lower middle one of an even count), to within half a bucket; None without any."""
        total = sum(self.paces.values())
        if not total:
            return None
        seen = 0
        for bucket in sorted(self.paces):
            seen += self.paces[bucket]
            if 2 * seen >= total:
                return bucket_pace(bucket)
        raise AssertionError("unreachable: the counts add up to the total")


def deadlines(*, plan: Plan, arrivals: Arrivals, grace: float, floor: float, ceiling: float) -> Deadlines:
    """Deadlines for a round with this plan, given the arrivals so far. `grace` covers transfers and checks;
    the soft deadline stays within [floor, ceiling].

    - No arrival yet: the plan's slowest unit × PLAN_SLACK (the ceiling when a unit has no plan).
    - Arrivals: the round is predicted to take its slowest unit's plan at the median pace of the arrivals
      (elapsed / expected); without planned seconds, the latest arrival's time. The deadline gives that
      prediction ARRIVAL_SLACK, and never falls before the latest arrival seen (the round is at least that slow).
    """
    if not arrivals.count:
        soft = plan.slowest * PLAN_SLACK + grace if plan.complete else ceiling
    else:
        pace = arrivals.median_pace()
        predicted = arrivals.latest
        if pace is not None and plan.slowest > 0:
            predicted = max(plan.slowest * pace, arrivals.latest)
        soft = predicted * ARRIVAL_SLACK + grace
    soft = min(max(soft, floor), ceiling)
    return Deadlines(soft, 2 * soft)


def round_deadlines(*, outstanding: Sequence[float], arrivals: Sequence[Arrival], grace: float, floor: float,
                    ceiling: float) -> Deadlines:
    """`deadlines` computed afresh from every arrival, for a round whose other units have these planned seconds
    (0: unknown): the plan is theirs and the arrivals' together."""
    plan = plan_of([*outstanding, *(a.expected for a in arrivals)])
    seen = Arrivals()
    for arrival in arrivals:
        seen = seen.add(arrival)
    return deadlines(plan=plan, arrivals=seen, grace=grace, floor=floor, ceiling=ceiling)


def expected_seconds(flops: int, flops_per_s: float) -> float:
    """How long a unit of `flops` should take a device of this measured speed; 0 when the speed is unknown."""
    return flops / flops_per_s if flops_per_s > 0 else 0.0
