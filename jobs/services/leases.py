"""Leases: a device claims a queued unit it can run, keeps it with heartbeats, and loses it when it expires."""
from __future__ import annotations

import functools
import logging
import uuid
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from muninn import sql
from muninn.errors import Conflict

from .. import selectors
from ..models import Job, Round, WorkUnit


log = logging.getLogger(__name__)


def units_held(*, device_id: int) -> int:
    """How many units the device holds a lease on now."""
    return WorkUnit.objects.filter(status=WorkUnit.Status.LEASED, leased_device_id=device_id).count()


def unit_lease(*, device_id: int, resources: dict[str, int], lease_seconds: int | None = None,
               max_held: int | None = None, trusted: bool = False, templates=None) -> WorkUnit | None:
    """Lease one queued unit the device can run (one of its backends is among the job's, with the unit's memory on
    it: `resources` maps each backend to its memory in bytes): first one sized for it, then a
    straggler's backup (the round waits on it), then one nobody reserved, then one whose reservation for another
    device ran out (the oldest first); never a unit in its backoff
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
    expires = now + timedelta(seconds=lease_seconds)
    templates = None if templates is None else tuple(templates)
    # Each pass leases the first candidate no other claim holds, in one statement (a queue's UPDATE ... WHERE id =
    # (SELECT ... LIMIT 1) RETURNING the leased row), unless the device holds max_held already. On PostgreSQL the
    # pick is FOR UPDATE SKIP LOCKED, so concurrent claims each take another row; SQLite has one writer at a time.
    # The SQL is written once per shape of claim (its database, backends, trust, templates), not built by the ORM on
    # every claim: building it cost more CPU than running it.
    backends = tuple(sorted(resources))
    at = functools.partial(sql.value, WorkUnit, "lease_expires_at")  # a datetime as the database stores one
    params = {"device": device_id, "now": at(now), "expires": at(expires), "max_held": max_held,
              "token": sql.value(WorkUnit, "lease_token", uuid.uuid4()),
              "refused_after": at(now - timedelta(seconds=settings.MUNINN_UNIT_BACKOFF_MAX_SECONDS)),
              **{f"memory_{b}": resources[b] for b in backends},
              **{f"template_{n}": t for n, t in enumerate(templates or ())}}
    for number in range(len(_PASSES)):
        row = sql.fetch_one(_lease_sql(connection.vendor, backends, number, trusted,
                                       None if templates is None else len(templates)), params)
        if row is not None:
            unit = sql.instance(WorkUnit, row[:len(WorkUnit._meta.concrete_fields)])  # (then sql.unflushed's column)
            unit.round = selectors.round_fixed(unit.round_id)
            return unit
    return None


# A claim's passes (see unit_lease), each one index walk that stops at the first row that fits: the units sized
# for this device, a straggler's backup, a unit nobody reserved, then one whose reservation for another device ran
# out (the oldest reservation first). As one pass in id order, the last two walked every queued unit when all were
# reserved for other devices (a device with no shard of its own, answered 204: 54 ms at 37,000 units).
_PASSES = (
    ("u.preferred_device_id = %(device)s", "u.id"),
    ("(u.preferred_device_id IS NULL OR u.reserved_until < %(now)s) AND u.backup_of_id IS NOT NULL", "u.id"),
    ("u.preferred_device_id IS NULL", "u.id"),
    ("u.preferred_device_id IS NOT NULL AND u.reserved_until < %(now)s", "u.reserved_until, u.id"),
)


@functools.cache
def _lease_sql(vendor: str, backends: tuple[str, ...], number: int, trusted: bool, templates: int | None) -> str:
    unit, rnd, job = sql.table(WorkUnit), sql.table(Round), sql.table(Job)
    dataset = sql.table(Job._meta.get_field("dataset").related_model)
    runnable = " OR ".join(
        f"(j.backends LIKE {sql.literal(_backend_pattern(b))} AND u.min_memory_bytes <= %(memory_{b})s)"
        for b in backends) or "false"
    # The statuses are written into the text (sql.literal: the partial indexes unit_queued_preferred and
    # unit_leased_device then serve the prepared statement's generic plan too).
    queued, leased = sql.literal(WorkUnit.Status.QUEUED), sql.literal(WorkUnit.Status.LEASED)
    where = [
        f"u.status = {queued}", f"r.status = {sql.literal(Round.Status.OPEN)}",
        f"j.status = {sql.literal(Job.Status.RUNNING)}", f"({runnable})",
        "(u.not_before IS NULL OR u.not_before <= %(now)s)",
        # never a unit refused from this device for a while, nor the backup of a unit this device is running
        "NOT COALESCE(u.refused_device_id = %(device)s AND u.not_before > %(refused_after)s, false)",
        # (a scalar subquery, one probe of the original by its id: as NOT EXISTS, the plan for any device hashed
        # the whole units' table on the first backup it met, one scan per claim)
        f"(u.backup_of_id IS NULL OR COALESCE((SELECT o.leased_device_id FROM {unit} o WHERE o.id = u.backup_of_id), "
        "0) <> %(device)s)",
        _PASSES[number][0],
    ]
    joins = f"JOIN {rnd} r ON r.id = u.round_id JOIN {job} j ON j.id = r.job_id"
    if not trusted:
        joins += f" JOIN {dataset} d ON d.id = j.dataset_id"
        where.append("NOT d.sensitive")
    if templates is not None:
        where.append(f"j.template IN ({', '.join(f'%(template_{n})s' for n in range(templates))})"
                     if templates else "false")
    lock = " FOR UPDATE OF u SKIP LOCKED" if vendor == "postgresql" else ""
    order = _PASSES[number][1]
    pick = f"SELECT u.id FROM {unit} u {joins} WHERE {' AND '.join(where)} ORDER BY {order} LIMIT 1{lock}"
    return (f"UPDATE {unit} SET status = {leased}, lease_token = %(token)s, leased_device_id = %(device)s, "
            f"lease_expires_at = %(expires)s, attempts = attempts + 1 WHERE id = ({pick}) AND status = {queued} "
            f"AND (SELECT count(*) FROM {unit} held WHERE held.status = {leased} AND held.leased_device_id = "
            f"%(device)s) < %(max_held)s RETURNING {sql.columns(WorkUnit)}{sql.unflushed(vendor)}")


def unit_heartbeat_holder(*, unit_id: int, device_id: int, lease_seconds: int | None = None) -> datetime | None:
    """Extend the lease of a unit leased to this device now (whichever of its leases: a device holds one lease
    of a unit at a time); None when it holds none."""
    expires = timezone.now() + timedelta(seconds=lease_seconds or settings.MUNINN_LEASE_SECONDS)
    extended = sql.execute(_heartbeat_sql(connection.vendor), [sql.value(WorkUnit, "lease_expires_at", expires),
                                                               unit_id, WorkUnit.Status.LEASED, device_id])
    return expires if extended else None


@functools.cache
def _heartbeat_sql(vendor: str) -> str:
    """The holder's heartbeat, written once (muninn/sql.py: why); its commit does not wait for the disk."""
    return (f"UPDATE {sql.table(WorkUnit)} SET lease_expires_at = %s "
            f"WHERE id = %s AND status = %s AND leased_device_id = %s{sql.unflushed_returning(vendor)}")


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


def _backend_pattern(backend: str) -> str:
    """A backend's pattern in a job's `backends` ("cpu,cuda"), written into the claim's text: the planner then knows
    how many jobs it matches, and the claim's one plan for any values (its generic plan) walks the queue's index
    instead of starting from the jobs. A name of the code's (selectors.BACKEND_NAMES), never a request's string."""
    if backend not in selectors.BACKEND_NAMES:
        raise ValueError(f"unknown backend {backend!r}")
    return f"%%{backend}%%"  # (a statement with parameters writes a literal % as %%)
