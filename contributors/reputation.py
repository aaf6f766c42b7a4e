"""How much the platform trusts a device: pure arithmetic, after BOINC's adaptive replication.

New devices have every result re-executed; a device whose results keep agreeing is checked less and less
often (never below MIN_RATE); one disagreement resets its streak, and repeated failures quarantine it.
"""
from __future__ import annotations

import hashlib

TRUST_AFTER = 5  # consecutive verified results before the re-execution rate starts to fall
MIN_RATE = 0.05
QUARANTINE_AFTER = 3  # failed results (since the last lifted quarantine)


def reexecution_rate(streak: int, *, trust_after: int = TRUST_AFTER, min_rate: float = MIN_RATE) -> float:
    """1 until `trust_after` consecutive agreements, then trust_after/(streak+1), floored at min_rate."""
    if streak < trust_after:
        return 1.0
    return max(min_rate, trust_after / (streak + 1))


def draw(secret: str, unit_id: int, lease_token: str) -> float:
    """A uniform number in [0, 1) the device cannot predict (it never sees the secret) and that is the
    same every time it is recomputed for the same lease."""
    digest = hashlib.sha256(f"{secret}:{unit_id}:{lease_token}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def should_reexecute(streak: int, draw_value: float) -> bool:
    return draw_value < reexecution_rate(streak)


def quarantine_due(failures: int, *, limit: int = QUARANTINE_AFTER) -> bool:
    return failures >= limit
