"""Leases: a device claims a queued unit it can run, keeps it with heartbeats, and loses it when it expires."""
from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from muninn.errors import Conflict

from .. import selectors
from ..models import Job, Round, WorkUnit


log = logging.getLogger(__name__)


def _runnable_on(resources: dict[str, int]) -> Q:
    """Units a device can run: one of its backends is among the job's, with the unit's memory on it.
    `resources` maps each backend the device offers ("cpu", "cuda", "mps") to its memory in bytes."""
    runnable = Q(pk__in=[])
    for backend, memory in resources.items():
        runnable |= Q(round__job__backends__contains=backend, min_memory_bytes__lte=memory)
    return runnable


def units_held(*, device_id: int) -> int:
    """How many units the device holds a lease on now."""
    return WorkUnit.objects.filter(status=WorkUnit.Status.LEASED, leased_device_id=device_id).count()


def unit_lease(*, device_id: int, resources: dict[str, int], lease_seconds: int | None = None,
               max_held: int | None = None, trusted: bool = False, templates=None) -> WorkUnit | None:
    """Lease one queued unit the device can run (see _runnable_on): first one sized for it, then a
    straggler's backup (the round waits on it), then one nobody else has reserved; never a unit in its backoff
    after a refusal (nor, for a minute more, one refused from this device); never the backup of a
    unit this device is itself running. Never the same unit to two devices: rows are locked with SKIP
    LOCKED where the database has it, and the lease itself is a conditional update on the status. Nothing while
    the device already holds `max_held` units (MUNINN_MAX_LEASES_PER_DEVICE): a unit held is a unit nobody else
    can run. A unit of a sensitive dataset (Dataset.sensitive) only when `trusted`: the caller found the device
    meets the site's trust level for such data (contributors.exposure). `templates`: only units of jobs of these
    templates (a browser trains a few; None: any). Returns the unit with its round and job loaded."""
    lease_seconds = lease_seconds or settings.MUNINN_LEASE_SECONDS
    max_held = max_held or settings.MUNINN_MAX_LEASES_PER_DEVICE
    now = timezone.now()
    queued = WorkUnit.objects.filter(
        _runnable_on(resources), Q(not_before__isnull=True) | Q(not_before__lte=now),
        status=WorkUnit.Status.QUEUED, round__status=Round.Status.OPEN, round__job__status=Job.Status.RUNNING,
    ).exclude(backup_of__leased_device_id=device_id).exclude(
        refused_device_id=device_id,
        not_before__gt=now - timedelta(seconds=settings.MUNINN_UNIT_BACKOFF_MAX_SECONDS))
    if not trusted:  # one more condition on the job's dataset row, joined by its primary key
        queued = queued.filter(round__job__dataset__sensitive=False)
    if templates is not None:
        queued = queued.filter(round__job__template__in=list(templates))
    unreserved = Q(preferred_device_id__isnull=True) | Q(reserved_until__lt=now)
    lease = {"status": WorkUnit.Status.LEASED, "leased_device_id": device_id,
             "lease_expires_at": now + timedelta(seconds=lease_seconds)}
    # Passes in id order, each an index walk that stops at the first rows that fit: a claim costs the
    # same with a hundred or a hundred thousand units queued (one ORDER BY putting the device's own
    # first would sort every queued unit on every claim).
    with transaction.atomic(savepoint=False):  # nothing here to undo on its own: a failure fails the caller's claim
        for candidates in (queued.filter(preferred_device_id=device_id),
                           queued.filter(unreserved, backup_of__isnull=False),
                           queued.filter(unreserved)):
            candidates = candidates.order_by("id")
            if connection.vendor == "postgresql":
                unit = _lease_first(candidates, token=uuid.uuid4(), max_held=max_held, **lease)
            else:
                if units_held(device_id=device_id) >= max_held:
                    return None
                unit_id = _lease_one_of(candidates[:4], token=uuid.uuid4(), **lease)
                unit = None if unit_id is None else WorkUnit.objects.get(pk=unit_id)
            if unit is not None:
                unit.round = selectors.round_fixed(unit.round_id)
                return unit
    return None


def _lease_first(candidates, *, token: uuid.UUID, status: str, leased_device_id: int, lease_expires_at,
                 max_held: int) -> WorkUnit | None:
    """PostgreSQL: lease the first candidate no other claim holds, in one statement (a queue's UPDATE ... WHERE id
    = (SELECT ... FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING the leased row), unless the device holds max_held."""
    pick, params = candidates.select_for_update(skip_locked=True, of=("self",)).values("id")[:1].query.sql_with_params()
    table = WorkUnit._meta.db_table
    leased = WorkUnit.objects.raw(
        f'UPDATE "{table}" SET status = %s, lease_token = %s, leased_device_id = %s, lease_expires_at = %s, '
        f'attempts = attempts + 1 WHERE id = ({pick}) AND status = %s AND (SELECT count(*) FROM "{table}" held '
        f'WHERE held.status = %s AND held.leased_device_id = %s) < %s RETURNING *',
        [status, token, leased_device_id, lease_expires_at, *params, WorkUnit.Status.QUEUED,
         WorkUnit.Status.LEASED, leased_device_id, max_held])
    return next(iter(leased), None)


def _lease_one_of(candidates, *, token: uuid.UUID, **lease) -> int | None:
    """Elsewhere (SQLite: one writer at a time): the first candidate whose conditional update wins."""
    if connection.features.has_select_for_update_skip_locked:
        candidates = candidates.select_for_update(skip_locked=True, of=("self",))
    for unit_id in candidates.values_list("id", flat=True):
        if WorkUnit.objects.filter(pk=unit_id, status=WorkUnit.Status.QUEUED).update(
                lease_token=token, attempts=F("attempts") + 1, **lease):
            return unit_id
    return None


def unit_heartbeat_holder(*, unit_id: int, device_id: int, lease_seconds: int | None = None) -> datetime | None:
    """Extend the lease of a unit leased to this device now (whichever of its leases: a device holds one lease
    of a unit at a time); None when it holds none."""
    expires = timezone.now() + timedelta(seconds=lease_seconds or settings.MUNINN_LEASE_SECONDS)
    extended = WorkUnit.objects.filter(pk=unit_id, status=WorkUnit.Status.LEASED, leased_device_id=device_id).update(
        lease_expires_at=expires)
    return expires if extended else None


def unit_heartbeat(*, unit_id: int, lease_token: uuid.UUID, lease_seconds: int | None = None) -> datetime:
    expires = timezone.now() + timedelta(seconds=lease_seconds or settings.MUNINN_LEASE_SECONDS)
    extended = WorkUnit.objects.filter(pk=unit_id, status=WorkUnit.Status.LEASED, lease_token=lease_token).update(
        lease_expires_at=expires)
    if not extended:
        raise Conflict("This unit is no longer leased to you.", code="lease_lost")
    return expires


def units_requeue_expired(*, now: datetime | None = None) -> int:
    """Leases past their expiry go back to the queue, open to any device (a new lease gets a new token, so
    a late result from the old holder is refused). Safe to run any number of times. Returns how many."""
    return len(leases_expire(now=now))


def leases_expire(*, now: datetime | None = None) -> list[tuple[int, int]]:
    """units_requeue_expired, returning (unit id, device id) of each lease that expired: its device abandoned it
    (the task layer holds that against the device: contributors.services.devices_record_abandoned)."""
    now = now or timezone.now()
    with transaction.atomic():
        expired = WorkUnit.objects.filter(status=WorkUnit.Status.LEASED, lease_expires_at__lt=now)
        if connection.features.has_select_for_update_skip_locked:
            expired = expired.select_for_update(skip_locked=True)
        abandoned = list(expired.values_list("id", "leased_device_id"))
        WorkUnit.objects.filter(pk__in=[unit_id for unit_id, _ in abandoned], status=WorkUnit.Status.LEASED,
                                lease_expires_at__lt=now).update(
            status=WorkUnit.Status.QUEUED, lease_token=None, lease_expires_at=None, preferred_device_id=None,
            reserved_until=None)
    return abandoned
