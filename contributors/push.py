"""Long-poll claims: work is pushed to a waiting device, not polled for.

A claim with a wait is held until a unit the device can run is queued, then answered with it at once; 204
when the wait runs out. The wake-up comes from jobs/wakeups.py (Redis pub/sub, or a stamp file on one
machine); the claim itself is always services.unit_claim, run again after each wake-up and every
MUNINN_CLAIM_RECHECK_SECONDS.

A held claim holds a web thread, so each process holds at most MUNINN_CLAIM_WAITERS at a time: a claim
beyond that is answered 204 at once with a Retry-After (WaitersFull), and the device asks again later.
"""
from __future__ import annotations

import logging
import threading
import time

from django.conf import settings

from jobs import wakeups

from . import services
from .models import Device

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2  # what a device turned away for lack of room is told to wait
TURNED_AWAY_LOG_S = 10.0  # at most one warning per this many seconds per process, with the count since the last


class WaitersFull(Exception):
    """This process already holds MUNINN_CLAIM_WAITERS claims."""

    retry_after = RETRY_AFTER_S


class _Slots:
    """A counter of held claims, per process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0
        self.refused = 0  # turned away since the last warning
        self._warned_at = -TURNED_AWAY_LOG_S

    def take(self, limit: int) -> bool:
        with self._lock:
            if self.held >= limit:
                return False
            self.held += 1
            return True

    def give(self) -> None:
        with self._lock:
            self.held -= 1

    def turned_away(self, limit: int) -> None:
        """Count a claim turned away; warn now and then: the operator's sign to add web processes (or threads and
        MUNINN_CLAIM_WAITERS), and to know that the devices turned away start work a Retry-After late."""
        with self._lock:
            self.refused += 1
            now = time.monotonic()
            if now - self._warned_at < TURNED_AWAY_LOG_S:
                return
            count, self.refused, self._warned_at = self.refused, 0, now
        log.warning("turned away %d claim(s) with Retry-After %d s: this process already holds %d waiting claims "
                    "(MUNINN_CLAIM_WAITERS)", count, RETRY_AFTER_S, limit)


waiting = _Slots()


def unit_claim_wait(*, device: Device, wait: float, backends=None) -> services.Claim | None:
    """services.unit_claim, held up to `wait` seconds (at most MUNINN_CLAIM_WAIT_MAX) until it finds something.
    `wait` 0: one claim, answered at once. Raises WaitersFull when this process holds too many claims already.
    `backends`: work for those of the device's backends only (services.unit_claim)."""
    token = wakeups.mark() if wait > 0 else None  # before the claim: a unit queued meanwhile still wakes us
    claim = services.unit_claim(device=device, backends=backends)
    if claim is not None or wait <= 0 or wakeups.stopping():
        return claim
    if not waiting.take(settings.MUNINN_CLAIM_WAITERS):
        waiting.turned_away(settings.MUNINN_CLAIM_WAITERS)
        raise WaitersFull(f"This server holds {settings.MUNINN_CLAIM_WAITERS} waiting claims already.")
    try:
        return _wait(device, min(wait, settings.MUNINN_CLAIM_WAIT_MAX), token, backends)
    finally:
        waiting.give()


def _wait(device: Device, wait: float, token: object, backends=None) -> services.Claim | None:
    deadline = time.monotonic() + wait
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or wakeups.stopping():
            return None
        token = wakeups.wait(token, min(left, settings.MUNINN_CLAIM_RECHECK_SECONDS))
        if wakeups.stopping():
            return None
        claim = services.unit_claim(device=device, backends=backends)
        if claim is not None:
            return claim
