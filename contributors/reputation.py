"""How much the platform trusts a device: pure arithmetic, after BOINC's adaptive replication.

Every result is checked before it counts (MIN_RATE = 1: one segment of every unit, so that no update reaches a
model unchecked, however long the device's record). An operator may lower the floor (MUNINN_MIN_CHECK_RATE):
then a device whose results keep agreeing is checked less and less often, down to that floor; one disagreement resets its streak and holds the earnings of its unverified work
for review (HOLD_AFTER), and failures confirmed on QUARANTINE_AFTER different units quarantine it. A check re-trains CHALLENGED_SEGMENTS segments of the unit, drawn with the
site's secret after the device has committed to every checkpoint, so it cannot know which ones.
"""
from __future__ import annotations

import hashlib

TRUST_AFTER = 5  # consecutive verified results before the re-execution rate starts to fall
# The floor of the check rate. 1: every result has a segment re-trained before it is aggregated or credited (a
# trusted device that turned to under-training had 12 updates aggregated unchecked at a 0.05 floor). The
# adaptive curve below it is for operators who trade that for validator time (MUNINN_MIN_CHECK_RATE).
MIN_RATE = 1.0
ADAPTIVE_MIN_RATE = 0.05  # the floor BOINC-style adaptive checking used before (bench/cheating.py compares)
QUARANTINE_AFTER = 3  # units with a confirmed failure (since the last lifted quarantine)
# A confirmed failure holds the device's unverified, uncleared earnings for review at once (staff release or
# forfeit them): without it a trusted device skipping a small share of its work was caught too seldom to lose
# more than it saved (bench/cheating.py: +0.26 per unit of work skipped; with it, below -1).
HOLD_AFTER = 1
CHALLENGED_SEGMENTS = 1  # segments re-trained per checked unit (every one, up to SUSPECT_SEGMENTS, when suspect)
SUSPECT_SEGMENTS = 64


def reexecution_rate(streak: int, *, trust_after: int = TRUST_AFTER, min_rate: float = MIN_RATE) -> float:
    """1 until `trust_after` consecutive agreements, then trust_after/(streak+1), floored at min_rate (1 at the
    default floor: every result)."""
    if streak < trust_after:
        return 1.0
    return max(min_rate, trust_after / (streak + 1))


def draw(secret: str, unit_id: int, lease_token: str) -> float:
    """A uniform number in [0, 1) the device cannot predict (it never sees the secret) and that is the
    same every time it is recomputed for the same lease."""
    digest = hashlib.sha256(f"{secret}:{unit_id}:{lease_token}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def should_reexecute(streak: int, draw_value: float, *, min_rate: float = MIN_RATE) -> bool:
    return draw_value < reexecution_rate(streak, min_rate=min_rate)


def quarantine_due(failed_units: int, *, limit: int = QUARANTINE_AFTER) -> bool:
    """`failed_units`: distinct units whose failure was confirmed (a re-training that disagreed, a checkpoint
    that is not what was committed, a challenge left unanswered, a forged or inconsistent receipt)."""
    return failed_units >= limit


def hold_due(failed_units: int, *, limit: int = HOLD_AFTER) -> bool:
    """Whether the device's unverified earnings are held for review now (see HOLD_AFTER)."""
    return failed_units >= limit


def draw_segments(secret: str, unit_id: int, lease_token: str, segments: int, *, suspect: bool = False) -> list[int]:
    """Which segments (0-based) to re-train: CHALLENGED_SEGMENTS of them drawn with the secret, or, for a result
    a cheap check found odd, every one (the last SUSPECT_SEGMENTS when there are more: an odd final state is
    most likely made late). The same every time for the same lease."""
    if suspect:
        return list(range(max(0, segments - SUSPECT_SEGMENTS), segments))
    order = sorted(range(segments), key=lambda j: hashlib.sha256(f"{secret}:{unit_id}:{lease_token}:segment:{j}"
                                                                 .encode()).digest())
    return sorted(order[:CHALLENGED_SEGMENTS])
