"""A unit's result: accepted (or checked first), verified, refused or rejected, and queued again after a
backoff; how a unit trains (its steps, its samples)."""
from __future__ import annotations

import functools
import logging
import uuid
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from muninn_worker import flops as worker_flops
from muninn_worker.federated import plan

from muninn import sql
from muninn.errors import Conflict

from .. import wakeups
from ..models import Round, WorkUnit

from .rounds import (_round_arrival_statement, _round_complete, _round_deadlines_moved, _round_reschedule,
                     round_locked)

log = logging.getLogger(__name__)


def unit_train_spec(unit: WorkUnit) -> dict:
    """How a unit is trained: the arguments of `training.train_local`, the same for the device that does
    the work and for the validator that re-executes it (DiLoCo: `inner_steps` steps instead of epochs)."""
    job = unit.round.job
    return plan.unit_train_args(job.template, job.hparams, seed=unit.seed, inner_steps=job.inner_steps)


def unit_steps(unit: WorkUnit) -> int:
    """The optimizer steps a unit's training takes (epochs × batches of its shard, or DiLoCo's inner_steps),
    counted by the site from the unit, never taken from the device's receipt."""
    job = unit.round.job
    if job.inner_steps:
        return job.inner_steps
    return job.hparams["epochs"] * -(-unit.samples // job.hparams["batch_size"])


def unit_work_samples(unit: WorkUnit) -> int:
    """The samples a unit's training passes over (its shard × epochs, or DiLoCo's inner_steps × batch): what a
    device's speed is measured against."""
    job = unit.round.job
    return worker_flops.train_samples(unit.samples, job.hparams["epochs"], inner_steps=job.inner_steps,
                                      batch_size=job.hparams["batch_size"])


SUPERSEDED = "Another device's result for the same shard was accepted first (this unit was a straggler's "\
             "backup, or had one); this result is not credited."


def unit_accept(*, unit_id: int, lease_token: uuid.UUID, result_sha256: str, samples: int,
                metrics: dict, verify: bool = False, unit: WorkUnit | None = None) -> tuple[WorkUnit, bool]:
    """Record a result that passed the cheap checks: accepted at once, or `verify`ing until a re-execution
    agrees (see unit_verified / unit_reject). An accepted result cancels its shard's other copy (a
    straggler and its backup: the first valid result wins). Its arrival moves the round's deadlines.
    Returns (unit, round_complete). Must run inside the caller's transaction so that the receipt commits with
    it. The round row is locked first, so an aggregation never misses a result it has already been told about,
    and two copies of one shard are never both accepted. `unit`: the unit as the caller loaded it (with its round
    and job), updated in place rather than read again."""
    if unit is None:
        unit = WorkUnit.objects.select_related("round__job").get(pk=unit_id)
    now = timezone.now()
    fields = _accepted_fields(verify=verify, now=now, result_sha256=result_sha256, samples=samples, metrics=metrics)
    # One conditional update: still leased to this lease, in a round still open (the round's lock is held).
    rnd, updated = _round_locked_unit_updated(unit.round_id, fields, unit_id=unit_id, lease_token=lease_token)
    if not updated:
        _refuse_accept(WorkUnit.objects.get(pk=unit_id), rnd)
    for field, value in fields.items():
        setattr(unit, field, value)
    copies = None if verify else _cancel_copies_statement(shards=[unit.backup_of_id or unit.pk], winners=[unit.pk])
    if copies is not None and connection.vendor != "postgresql":  # PostgreSQL runs it in the round's statement
        sql.execute(*copies)
        copies = None
    if unit.backup_of_id is not None:  # a backup's arrival stands for its original's
        WorkUnit.objects.filter(pk=unit.backup_of_id, submitted_at__isnull=True).update(submitted_at=now)
    job = unit.round.job
    complete = _round_reschedule(rnd, now, unit=unit, complete=not verify,  # a unit being verified keeps it open
                                 cancelling=copies)
    rnd.job = job
    unit.round = rnd
    return unit, complete


# What unit_accept_with's first statement leaves for the statements after it in its transaction: whether the unit was
# accepted (a setting local to the transaction, gone at its end; NULL or '' in any other).
ACCEPTED_HERE = "current_setting('muninn.unit_accepted', true) = '1'"


def unit_accept_with(row, *, unit: WorkUnit, lease_token: uuid.UUID, result_sha256: str, samples: int, metrics: dict,
                     verify: bool = False) -> tuple[WorkUnit, bool]:
    """unit_accept, and `row` (a new model instance: the result's receipt; or None) inserted in the same
    transaction; `row.pk` is set. `unit`: as the caller loaded it, with its round and job. Conflict (nothing
    written) when the unit cannot be accepted; a database error (nothing written) when `row` cannot be inserted.

    On PostgreSQL the acceptance is four statements sent together with their BEGIN and COMMIT (sql.run_together):
    the round locked and the unit updated (only while leased under `lease_token` in that round while it is open,
    which the statement records in ACCEPTED_HERE), the original's arrival for a backup, the round's statistic (and
    the copies' cancellation and the round-complete test), and `row`, each of the last three only when the unit was
    accepted. Each statement reads the database as it is when it runs, after the lock (READ COMMITTED), as separate
    round trips would; but the round's lock, which every result of the round waits on, is held for the server's
    time alone: under bench/load.py it was held through two round trips and the GIL waits before each, and the
    results of the round queued on it. The arrival's statement moves the deadlines as far as its time alone says;
    when the median pace moves them too (rarely), they are written after the commit (_round_deadlines_moved).
    Elsewhere: `row` inserted, then unit_accept, in one transaction."""
    if connection.vendor != "postgresql":
        with transaction.atomic():
            if row is not None:
                sql.insert(row)
            return unit_accept(unit_id=unit.pk, lease_token=lease_token, result_sha256=result_sha256,
                               samples=samples, metrics=metrics, verify=verify, unit=unit)
    now = timezone.now()
    fields = _accepted_fields(verify=verify, now=now, result_sha256=result_sha256, samples=samples, metrics=metrics)
    statements = [_round_locked_unit_updated_statement(unit.round_id, fields, unit_id=unit.pk,
                                                       lease_token=lease_token, flagged=True)]
    if unit.backup_of_id is not None:  # a backup's arrival stands for its original's
        statements.append((_original_arrived_sql(), [sql.value(WorkUnit, "submitted_at", now), unit.backup_of_id]))
    copies = None if verify else _cancel_copies_statement(shards=[unit.backup_of_id or unit.pk], winners=[unit.pk])
    statements.append(_round_arrival_statement(unit.round, now, unit=unit, when=ACCEPTED_HERE,
                                               complete=not verify, cancelling=copies))
    if row is not None:
        statements.append(sql.insert_when(row, ACCEPTED_HERE))
    found = sql.run_together(statements)
    if not found[0]:
        raise Round.DoesNotExist(f"There is no round {unit.round_id}.")
    rnd, updated = sql.instance(Round, found[0][0][:-2]), bool(found[0][0][-2])
    if not updated:
        _refuse_accept(WorkUnit.objects.get(pk=unit.pk), rnd)
    if row is not None:
        row.pk = found.pop()[0][0]
        row._state.adding, row._state.db = False, connection.alias
    for field, value in fields.items():
        setattr(unit, field, value)
    arrived = found[-1][0]  # the round's deadlines as the arrival left them (and whether it is complete)
    complete = not verify and bool(arrived[2])
    _round_deadlines_moved(rnd, now, unit=unit, written=arrived[:2])
    rnd.job = unit.round.job
    unit.round = rnd
    return unit, complete


def _accepted_fields(*, verify: bool, now, result_sha256: str, samples: int, metrics: dict) -> dict:
    return {"status": WorkUnit.Status.VERIFYING if verify else WorkUnit.Status.ACCEPTED,
            "accepted_at": None if verify else now, "result_sha256": result_sha256, "result_samples": samples,
            "result_metrics": metrics, "lease_expires_at": None, "submitted_at": now}


@functools.cache
def _original_arrived_sql() -> str:
    return (f"UPDATE {sql.table(WorkUnit)} SET submitted_at = %s WHERE id = %s AND submitted_at IS NULL "
            f"AND {ACCEPTED_HERE}")


def _round_locked_unit_updated(round_id: int, fields: dict, *, unit_id: int, lease_token) -> tuple[Round, bool]:
    """The round, locked (round_locked), and whether the unit, still leased under `lease_token` in that round while
    it is open, was updated with `fields`. On PostgreSQL in one statement: one round trip less under the round's
    lock, which every result of the round waits on. Its lock is taken before the unit's condition is tested (the
    condition reads the locked row), and it reads the round as committed when the lock was granted, as a statement
    of its own would (READ COMMITTED re-reads a row it waited for); a unit changed meanwhile is tested as it is
    now, as an UPDATE after a wait always is."""
    if connection.vendor != "postgresql":
        rnd = round_locked(round_id)
        return rnd, rnd.status == Round.Status.OPEN and bool(sql.update(WorkUnit, fields, **_leased_under(
            unit_id, lease_token)))
    row = sql.fetch_one(*_round_locked_unit_updated_statement(round_id, fields, unit_id=unit_id,
                                                              lease_token=lease_token))
    if row is None:
        raise Round.DoesNotExist(f"There is no round {round_id}.")
    return sql.instance(Round, row[:-1]), bool(row[-1])


def _leased_under(unit_id: int, lease_token) -> dict:
    return {"id": unit_id, "status": WorkUnit.Status.LEASED, "lease_token": lease_token}


def _round_locked_unit_updated_statement(round_id: int, fields: dict, *, unit_id: int, lease_token,
                                         flagged: bool = False) -> tuple[str, list]:
    """_round_locked_unit_updated's statement on PostgreSQL and its parameters (`flagged`: as in its SQL below)."""
    where = _leased_under(unit_id, lease_token)
    return (_round_locked_unit_updated_sql(tuple(fields), tuple(where), flagged=flagged),
            [round_id, *(sql.value(WorkUnit, f, v) for f, v in fields.items()),
             *(sql.value(WorkUnit, f, v) for f, v in where.items()), Round.Status.OPEN])


@functools.cache
def _round_locked_unit_updated_sql(columns_set: tuple[str, ...], columns_where: tuple[str, ...], *,
                                   flagged: bool = False) -> str:
    """sql.update's statement for the unit, as the WITH of the round's lock, and only while the round is open.
    `flagged`: whether it was updated is also left in ACCEPTED_HERE for the transaction's next statements."""
    flag = ", set_config('muninn.unit_accepted', (SELECT count(*) FROM u)::text, true)" if flagged else ""
    return (f"WITH r AS (SELECT {sql.columns(Round)} FROM {sql.table(Round)} WHERE id = %s FOR UPDATE), "
            f"u AS ({sql.update_sql(WorkUnit, columns_set, columns_where)} AND (SELECT status FROM r) = %s "
            f"RETURNING 1) SELECT r.*, (SELECT count(*) FROM u){flag} FROM r")


def _refuse_accept(unit: WorkUnit, rnd: Round) -> None:
    """Why a result for this unit cannot be accepted now (always raises Conflict)."""
    if unit.status in (WorkUnit.Status.ACCEPTED, WorkUnit.Status.VERIFYING):
        raise Conflict("This unit already has a result.", code="already_done")
    if unit.status == WorkUnit.Status.CANCELLED and rnd.status == Round.Status.OPEN:
        raise Conflict(SUPERSEDED, code="superseded")
    raise Conflict("This unit is no longer leased to you (the lease expired or the round closed).",
                   code="lease_lost")


def _cancel_copies(*, shards: list[int], winners: list[int]) -> int:
    """The other copies of these accepted units' shards (a straggler and its backups; a shard is named by its
    original's id) will not count: cancel them, so their late results are refused and the round need not wait for
    them. One statement (every acceptance runs it), its text fixed by the lists' lengths."""
    return sql.execute(*_cancel_copies_statement(shards=shards, winners=winners))


def _cancel_copies_statement(*, shards: list[int], winners: list[int]) -> tuple[str, list]:
    """_cancel_copies' statement and its parameters (an accepted result's runs inside the round's statement on
    PostgreSQL: rounds._round_reschedule's `cancelling`)."""
    marks = lambda n: ", ".join(["%s"] * n)  # noqa: E731
    return (f"UPDATE {sql.table(WorkUnit)} SET status = %s, lease_token = NULL, lease_expires_at = NULL "
            f"WHERE (id IN ({marks(len(shards))}) OR backup_of_id IN ({marks(len(shards))})) "
            f"AND id NOT IN ({marks(len(winners))}) AND status <> %s",
            [WorkUnit.Status.CANCELLED, *shards, *shards, *winners, WorkUnit.Status.ACCEPTED])


def unit_verified(*, unit_id: int) -> tuple[WorkUnit, bool]:
    """A re-execution agreed: the verifying result now counts. Returns (unit, round_complete). Raises Conflict
    "superseded" when its shard's other copy was accepted first."""
    verified, round_complete = units_verified(round_id=WorkUnit.objects.values("round_id").get(pk=unit_id)["round_id"],
                                              unit_ids=[unit_id])
    if unit_id not in verified:
        raise Conflict(SUPERSEDED, code="superseded")
    return verified[unit_id], round_complete


def units_verified(*, round_id: int, unit_ids: list[int]) -> tuple[dict[int, WorkUnit], bool]:
    """Re-executions agreed on these units of one round: their verifying results now count, under one lock of
    the round (a validator's batch: contributors.verification). Returns ({unit id: unit} of those verified,
    round_complete); a unit cancelled meanwhile, or whose shard's other copy comes before it in `unit_ids`
    (the first verified wins), is left out. Raises Conflict "not_verifying" for a unit in any other state. Must
    run inside the caller's transaction."""
    rnd = round_locked(round_id)
    now = timezone.now()
    locked = {unit.pk: unit for unit in  # locked in id order (no deadlock), verified in the order given
              WorkUnit.objects.select_for_update().filter(pk__in=unit_ids, round_id=round_id).order_by("pk")}
    verified, shards = {}, set()
    for unit in (locked[pk] for pk in unit_ids if pk in locked):
        shard = unit.backup_of_id or unit.pk  # a straggler and its backups share one (_cancel_copies)
        if unit.status == WorkUnit.Status.CANCELLED or shard in shards:  # or its copy was verified just before
            continue
        if unit.status != WorkUnit.Status.VERIFYING:
            raise Conflict(f"Unit {unit.pk} is {unit.status}, not verifying.", code="not_verifying")
        unit.status, unit.accepted_at, unit.round = WorkUnit.Status.ACCEPTED, now, rnd
        shards.add(shard)
        verified[unit.pk] = unit
    if verified:  # two statements for the batch: the round's lock is held until the transaction ends
        WorkUnit.objects.filter(pk__in=list(verified)).update(status=WorkUnit.Status.ACCEPTED, accepted_at=now)
        _cancel_copies(shards=list(shards), winners=list(verified))
    return verified, rnd.status == Round.Status.OPEN and _round_complete(rnd)


def unit_backoff_seconds(rejections: int) -> float:
    """How long a unit refused `rejections` times waits before it is leased again: doubling from
    MUNINN_UNIT_BACKOFF_SECONDS, capped at MUNINN_UNIT_BACKOFF_MAX_SECONDS."""
    base, cap = settings.MUNINN_UNIT_BACKOFF_SECONDS, settings.MUNINN_UNIT_BACKOFF_MAX_SECONDS
    return min(cap, base * 2 ** max(0, rejections - 1)) if rejections > 0 else 0.0


def _requeue_after_refusal(unit: WorkUnit) -> dict:
    """The fields that put a refused unit back in the queue, open to any device, after its backoff (the device
    refused waits longer: see unit_lease)."""
    rejections = unit.rejections + 1
    return {"status": WorkUnit.Status.QUEUED, "lease_token": None, "lease_expires_at": None,
            "preferred_device_id": None, "reserved_until": None, "rejections": rejections,
            "not_before": timezone.now() + timedelta(seconds=unit_backoff_seconds(rejections)),
            "refused_device_id": unit.leased_device_id}


def unit_release(*, unit_id: int, lease_token: uuid.UUID) -> bool:
    """The lease holder's result was refused: the unit goes back to the queue, open to any device, once its
    backoff has passed."""
    with transaction.atomic():
        unit = WorkUnit.objects.select_for_update().filter(pk=unit_id, status=WorkUnit.Status.LEASED,
                                                           lease_token=lease_token).first()
        if unit is None:
            return False
        WorkUnit.objects.filter(pk=unit.pk).update(**_requeue_after_refusal(unit))
        wakeups.units_queued_on_commit()
    return True


def unit_give_back(*, unit_id: int, lease_token: uuid.UUID) -> bool:
    """The lease holder gives the unit back before a result (its machine is shutting down, a browser tab closed):
    the unit is queued again at once, open to any device, as if never leased: no backoff (nothing was refused)
    and no reservation. False when that lease is no longer the unit's."""
    with transaction.atomic():
        given = WorkUnit.objects.filter(pk=unit_id, status=WorkUnit.Status.LEASED, lease_token=lease_token).update(
            status=WorkUnit.Status.QUEUED, lease_token=None, lease_expires_at=None, preferred_device_id=None,
            reserved_until=None)
        if given:
            wakeups.units_queued_on_commit()
    return bool(given)


def unit_reject(*, unit_id: int) -> WorkUnit:
    """A check disagreed (or the result could not be used): drop the result and queue the unit again, open to
    any device, after its backoff."""
    unit = WorkUnit.objects.select_for_update().get(pk=unit_id)
    if unit.status == WorkUnit.Status.CANCELLED:  # its shard's other copy was accepted meanwhile: nothing to redo
        return unit
    if unit.status != WorkUnit.Status.VERIFYING:
        raise Conflict(f"Unit {unit_id} is {unit.status}, not verifying.", code="not_verifying")
    for field, value in _requeue_after_refusal(unit).items():
        setattr(unit, field, value)
    unit.submitted_at = None
    unit.result_sha256, unit.result_samples, unit.result_metrics = "", None, {}
    unit.save()
    wakeups.units_queued_on_commit()
    return unit


def units_flag(*, unit_ids, reason: str) -> int:
    """Mark accepted updates whose device was caught on other work (WorkUnit.flagged). A round not aggregated
    yet leaves them out (round_aggregate); one aggregated already keeps them, and the mark says so. Units
    flagged already keep their first reason. Returns how many were marked."""
    return (WorkUnit.objects.filter(pk__in=list(unit_ids), status=WorkUnit.Status.ACCEPTED, flagged="")
            .update(flagged=reason[:500]))


def units_unflag(*, unit_ids) -> int:
    """Staff found the device honest (its held earnings released, its quarantine lifted): its marks go."""
    return WorkUnit.objects.filter(pk__in=list(unit_ids)).exclude(flagged="").update(flagged="")
