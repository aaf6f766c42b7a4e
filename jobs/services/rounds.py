"""Rounds: opened with one unit per capable device (shards sized by throughput), their deadlines kept as
results arrive, aggregated with the job's rule, and the ones beat must close or resume."""
from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Max, Q
from django.utils import timezone
from muninn_worker import tensors
from muninn_worker.federated import algorithms, robust
from muninn_worker.federated import plan as rounds_plan

from muninn import sql
from muninn.failpoints import failpoint

from .. import deadlines, selectors, storage
from ..models import Job, Round, WorkUnit
from ..shards import pack, shards_to_bytes

from .datasets import load_xy
from .jobs import _evaluate, _job_end, diverging_message, job_scheme, unit_flops

log = logging.getLogger(__name__)


def round_open(*, job_id: int, devices: Sequence[tuple[int, float]]) -> Round | None:
    """Open the job's next round: shard the training set across the capable devices online now, given as
    (device id, measured FLOP/s): sizes ∝ throughput so they finish together, each shard reserved for a
    while for the device it was sized for; no device or one device → one unit with everything. The
    deadlines come from the plan (jobs/deadlines.py). Idempotent: an open round is returned as it is; an
    ended job or a finished schedule opens nothing. Built for markets of 10,000 devices: the shards are cut
    from the training set's bytes at once (jobs/shards.py) and written as one blob, the round's pack (a file per
    shard was most of the time: the kernel's file creation), and the units go in as plain rows (_units_insert)."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.status != Job.Status.RUNNING:
            return None
        existing = job.round_set.filter(status=Round.Status.OPEN).first()
        if existing:
            return existing
        number = job.current_round + 1
        if number > job.rounds:
            return None
        key = selectors.job_data_key(job)
        X, y = load_xy(job.train_sha256, key=key)
        shards = rounds_plan.round_shards(job.n_train, [speed for _, speed in devices],
                                          batch_size=job.hparams["batch_size"])
        now = timezone.now()
        reserved_until = now + timedelta(seconds=settings.MUNINN_RESERVATION_SECONDS)
        blobs = shards_to_bytes(X, y, [(s.start, s.stop) for s in shards])
        if key is None:  # one file for the round, not one per unit: the kernel's file creation was most of it
            shard_shas = [storage.sha256_hex(blob) for blob in blobs]
            packed, offsets = pack(blobs)
            pack_sha = storage.blob_put(packed)
        else:  # a sensitive dataset's shards are sealed (and their downloads recorded) one by one
            shard_shas, offsets, pack_sha = storage.data_put_many(blobs, key=key), [None] * len(blobs), ""
        flops_of: dict[int, int] = {}  # shards of one size cost the same: most of a large round's sizes repeat
        rows = []
        for i, shard in enumerate(shards):
            samples = shard.stop - shard.start
            if samples not in flops_of:
                flops_of[samples] = unit_flops(job, samples)
            flops = flops_of[samples]
            planned = shard.device is not None
            rows.append((i, shard.start, shard.stop, shard_shas[i], offsets[i], len(blobs[i]) if pack_sha else None,
                         rounds_plan.unit_seed(job.seed, number, i), flops,
                         deadlines.expected_seconds(flops, devices[shard.device][1]) if planned else 0.0,
                         devices[shard.device][0] if planned else None, reserved_until if planned else None))
        plan = deadlines.plan_of(row[_PLANNED_FIELDS.index("expected_seconds")] for row in rows)
        soft, hard = _deadlines(plan=plan, arrivals=deadlines.Arrivals())
        rnd = Round.objects.create(job=job, number=number, weights_sha256=job.global_weights_sha256,
                                   shards_sha256=pack_sha, opened_at=now,
                                   deadline_at=now + timedelta(seconds=soft), close_at=now + timedelta(seconds=hard),
                                   plan_seconds=plan.slowest, plan_complete=plan.complete)
        _units_insert(common={"round": rnd, "min_memory_bytes": job.peak_memory_bytes}, fields=_PLANNED_FIELDS,
                      rows=rows)
        job.current_round = number
        job.save(update_fields=["current_round"])
    log.info("job %s: opened round %s with %s unit(s)", job.pk, number, len(shards))
    return rnd


STATISTICS_REFRESH_UNITS = 1000  # a round at least this big may have outgrown the planner's statistics


def units_statistics_refresh(*, added: int) -> bool:
    """ANALYZE the units' table when a round just added more units than the planner's statistics say the table
    holds (PostgreSQL only; returns whether it did). The worker API's statements run on plans made once per
    connection (settings: plan_cache_mode): a claim's plan made while a new site's table was nearly empty scans
    it whole, every claim of the first big round paying for it until autovacuum's next pass (up to a minute); fresh
    statistics replace every connection's plan at once. On a site with history the statistics already count more
    than a round adds, and nothing runs."""
    if connection.vendor != "postgresql" or added < STATISTICS_REFRESH_UNITS:
        return False
    table = sql.table(WorkUnit)
    with connection.cursor() as cursor:
        cursor.execute("SELECT reltuples FROM pg_class WHERE oid = %s::regclass", [table])
        known = cursor.fetchone()
        if known is not None and known[0] >= added:
            return False
        cursor.execute(f"ANALYZE {table}")
    log.info("analyzed %s: a round added %s units, its statistics counted %s", table, added,
             None if known is None else int(known[0]))
    return True


# What differs between the units round_open plans, in the order of its rows.
_PLANNED_FIELDS = ("index", "shard_start", "shard_stop", "shard_sha256", "shard_offset", "shard_size", "seed",
                   "flops", "expected_seconds", "preferred_device_id", "reserved_until")


def _units_insert(*, common: dict, fields: Sequence[str], rows: list[tuple]) -> None:
    """Insert work units: `rows` give the `fields` that differ between them as plain values, `common` the rest
    that is not a default. On PostgreSQL one COPY, with the common values prepared by their model fields once:
    bulk_create prepares every field of every unit, 1.5 s of a 10,000-unit round; elsewhere bulk_create."""
    if connection.vendor != "postgresql":
        WorkUnit.objects.bulk_create([WorkUnit(**common, **dict(zip(fields, row))) for row in rows])
        return
    template = WorkUnit(**common)
    concrete = WorkUnit._meta.concrete_fields
    varying = [WorkUnit._meta.get_field(name) for name in fields]
    constant = [f for f in concrete if not f.primary_key and f not in varying]
    values = tuple(f.get_db_prep_save(f.pre_save(template, add=True), connection) for f in constant)
    columns = ", ".join(connection.ops.quote_name(f.column) for f in [*varying, *constant])
    with connection.cursor() as cursor:
        with cursor.copy(f"COPY {connection.ops.quote_name(WorkUnit._meta.db_table)} ({columns}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row + values)


def round_aggregate(*, round_id: int) -> Round:
    """Combine the round's accepted results with the job's aggregation rule (FedAvg: weighted by samples);
    for DiLoCo, take the outer Nesterov step towards that and keep the momentum buffers; evaluate on the
    held-out split, close the round, and finish the job after its last round. Idempotent: a closed round is
    returned untouched (the weights and the momentum move in the transaction that closes it, so a re-run never
    applies them twice); a round with no accepted result yet is left open."""
    with transaction.atomic():
        rnd = Round.objects.select_for_update().get(pk=round_id)
        job = Job.objects.select_for_update().get(pk=rnd.job_id)
        if rnd.status == Round.Status.CLOSED or job.status != Job.Status.RUNNING:
            return rnd
        accepted = list(rnd.units.filter(status=WorkUnit.Status.ACCEPTED).order_by("index"))
        if not accepted:
            return rnd
        # Updates whose device was caught on other work since (units_flag) stay out while others are here.
        clean = [u for u in accepted if not u.flagged]
        left_out = [u.pk for u in accepted if u.flagged] if clean else []  # all flagged: they are all there is
        accepted = clean or accepted
        states = [tensors.bytes_to_state_dict(storage.blob_get(u.result_sha256)) for u in accepted]
        samples = [u.result_samples for u in accepted]
        global_state = tensors.bytes_to_state_dict(storage.blob_get(rnd.weights_sha256))
        combined = _combine(job, states, samples, global_state)
        momentum = (tensors.bytes_to_state_dict(storage.blob_get(job.outer_momentum_sha256))
                    if job.outer_momentum_sha256 else None)
        new_state, new_momentum = algorithms.next_global(job_scheme(job), global_state, combined, momentum)
        rnd.result_sha256 = storage.blob_put(tensors.state_dict_to_bytes(new_state))
        if new_momentum is not None:
            job.outer_momentum_sha256 = storage.blob_put(tensors.state_dict_to_bytes(new_momentum))

        evaluation = _evaluate(job, new_state)
        if not math.isfinite(evaluation["loss"]):  # verified updates that average to a diverged model
            _job_end(job, Job.Status.FAILED, diverging_message(job, rnd.number))
            return rnd
        rnd.metrics = {
            **{f"test_{name}": value for name, value in evaluation.items()},
            "train_loss": rounds_plan.train_loss([u.result_metrics.get("loss_after", 0.0) for u in accepted], samples),
            "samples": sum(samples),
            "units": len(accepted),
            **({"flagged_left_out": left_out} if left_out else {}),
        }
        rnd.units.filter(status__in=[WorkUnit.Status.QUEUED, WorkUnit.Status.LEASED]).update(
            status=WorkUnit.Status.CANCELLED, lease_token=None, lease_expires_at=None)
        rnd.status, rnd.closed_at = Round.Status.CLOSED, timezone.now()
        rnd.combined = [u.pk for u in accepted]
        rnd.save()
        job.global_weights_sha256 = rnd.result_sha256
        job.metrics = {**job.metrics, **rnd.metrics, "round": rnd.number}
        job.save(update_fields=["global_weights_sha256", "outer_momentum_sha256", "metrics"])
        if rnd.number >= job.rounds:
            _job_end(job, Job.Status.SUCCEEDED)
        failpoint("aggregate.before_commit")
    log.info("job %s round %s: %s", job.pk, rnd.number, rnd.metrics)
    return rnd


def _combine(job: Job, states: list, samples: list[int], global_state: dict) -> dict:
    """The job's aggregation rule; a trimmed mean with too few updates to trim falls back to the median."""
    return robust.aggregate(rounds_plan.round_rule(job.aggregation, len(states)), states, samples, global_state)


def _deadlines(*, plan: deadlines.Plan, arrivals: deadlines.Arrivals) -> deadlines.Deadlines:
    return deadlines.deadlines(
        plan=plan, arrivals=arrivals, grace=settings.MUNINN_ROUND_GRACE_SECONDS,
        floor=settings.MUNINN_ROUND_DEADLINE_MIN_SECONDS, ceiling=settings.MUNINN_ROUND_DEADLINE_SECONDS)


def _round_arrivals(rnd: Round) -> deadlines.Arrivals:
    """The round's running statistic of its arrivals, as jobs/deadlines.py reads it."""
    return deadlines.Arrivals(rnd.arrivals, rnd.latest_arrival_seconds,
                              {int(bucket): n for bucket, n in rnd.arrival_paces.items()})


def _round_reschedule(rnd: Round, now: datetime, *, unit: WorkUnit | None = None, complete: bool = False,
                      cancelling: tuple[str, list] | None = None) -> bool:
    """A result for `unit` arrived `now`: add it to the round's running statistic and move the deadlines to
    what the arrivals so far say, in constant time whatever the round's size (the caller holds the round's
    lock). Every result that arrives counts once, its unit's planned seconds giving its pace: a backup's
    arrival stands for its original's plan (a backup is a copy of it), and a result rejected later keeps the
    pace it showed (it arrived then; the cheap checks refused implausible times before it got here; the median
    shrugs off a few odd ones). Without `unit`, the unit whose result arrived `now` is looked up. `complete`: the
    same statement also answers _round_complete (an acceptance asks it next; one round trip less per result), and
    this returns its answer (False when not asked). `cancelling`, with `complete` on PostgreSQL: an UPDATE of units
    (its text and parameters: units._cancel_copies_statement) run as this statement's WITH, one statement less under
    the round's lock, which every result of the round waits on. The round-complete test sees the statement's
    snapshot, from before that UPDATE: the units it returns are left out of the test by their ids."""
    if unit is None:
        unit = rnd.units.filter(submitted_at=now).order_by("id").first()
    _arrived(rnd, now, unit)
    values = [sql.value(Round, f, getattr(rnd, f)) for f in _RESCHEDULED]
    if not complete:
        sql.execute(_reschedule_sql(complete=False), [*values, rnd.pk])
        return False
    if cancelling is None:
        row = sql.fetch_one(_reschedule_sql(complete=True), [*values, rnd.pk, rnd.pk, *_UNFINISHED])
    else:
        statement, params = cancelling
        row = sql.fetch_one(f"WITH cancelled AS ({statement} RETURNING id) "
                            f"{_reschedule_sql(complete=True, cancelled=True)}",
                            [*params, *values, rnd.pk, rnd.pk, *_UNFINISHED])
    return bool(row[0])


def _arrived(rnd: Round, now: datetime, unit: WorkUnit | None) -> None:
    """`rnd`, in memory, with `unit`'s result arriving `now` added to its statistic (none: only its deadlines
    recomputed) and its deadlines what the arrivals say."""
    seen = _round_arrivals(rnd)
    if unit is not None:
        seen = seen.add(_arrival(rnd, now, unit))
    soft, hard = _deadlines(plan=deadlines.Plan(rnd.plan_seconds, rnd.plan_complete), arrivals=seen)
    rnd.arrivals, rnd.latest_arrival_seconds = seen.count, seen.latest
    rnd.arrival_paces = {str(bucket): n for bucket, n in sorted(seen.paces.items())}
    rnd.deadline_at = rnd.opened_at + timedelta(seconds=soft)
    rnd.close_at = rnd.opened_at + timedelta(seconds=hard)


def _arrival(rnd: Round, now: datetime, unit: WorkUnit) -> deadlines.Arrival:
    return deadlines.Arrival((now - rnd.opened_at).total_seconds(), unit.expected_seconds)


def _column(field: str) -> str:
    return connection.ops.quote_name(Round._meta.get_field(field).column)


def _round_arrival_statement(rnd: Round, now: datetime, *, unit: WorkUnit, when: str, complete: bool,
                             cancelling: tuple[str, list] | None = None) -> tuple[str, list]:
    """_round_reschedule's running statistic, with `unit`'s result arriving `now`, added to in SQL (arrivals + 1, the
    latest, its pace's bucket + 1) when `when` holds: for a statement sent before the round's row is read
    (sql.run_together). It moves the deadlines as far as this arrival's time alone says (they never fall before the
    latest arrival: jobs/deadlines.py), and returns them; _round_deadlines_moved then finishes the job when the
    median pace moved them too. `rnd`: the round as read before its lock (only its opening time is used). `complete`
    and `cancelling` as in _round_reschedule (PostgreSQL only: a data-modifying WITH)."""
    came = _arrival(rnd, now, unit)
    bucket = str(deadlines.pace_bucket(*came)) if came.expected > 0 else None
    soft, hard = _deadlines(plan=deadlines.Plan(0.0, True), arrivals=deadlines.Arrivals(1, came.elapsed, {}))
    params = [came.elapsed, came.elapsed, bucket, bucket, bucket, timedelta(seconds=soft), timedelta(seconds=hard),
              rnd.pk]
    if not complete:
        return _arrival_sql(when, complete=False, cancelled=False), params
    params += [rnd.pk, *_UNFINISHED]
    if cancelling is None:
        return _arrival_sql(when, complete=True, cancelled=False), params
    statement, cancel_params = cancelling
    arrival = _arrival_sql(when, complete=True, cancelled=True)
    return f"WITH cancelled AS ({statement} AND {when} RETURNING id) {arrival}", [*cancel_params, *params]


@functools.cache
def _arrival_sql(when: str, *, complete: bool, cancelled: bool) -> str:
    """deadlines.Arrivals.add, in SQL, on the round's row (its columns on the right are the row before the update),
    and the deadlines at least this arrival's; returns them (and, with `complete`, _round_complete's answer)."""
    count, latest, paces = _column("arrivals"), _column("latest_arrival_seconds"), _column("arrival_paces")
    soft, hard, opened = _column("deadline_at"), _column("close_at"), _column("opened_at")
    statement = (f"UPDATE {sql.table(Round)} SET {count} = {count} + 1, "
                 f"{latest} = CASE WHEN {count} = 0 THEN %s ELSE GREATEST({latest}, %s) END, "
                 f"{paces} = CASE WHEN %s::text IS NULL THEN {paces} ELSE jsonb_set({paces}, ARRAY[%s::text], "
                 f"to_jsonb(COALESCE(({paces} ->> %s::text)::int, 0) + 1)) END, "
                 f"{soft} = GREATEST({soft}, {opened} + %s), {hard} = GREATEST({hard}, {opened} + %s) "
                 f"WHERE id = %s AND {when} RETURNING {soft}, {hard}")
    if complete:
        left_out = " AND id NOT IN (SELECT id FROM cancelled)" if cancelled else ""
        statement += (f", NOT EXISTS (SELECT 1 FROM {sql.table(WorkUnit)} WHERE round_id = %s "
                      f"AND status IN (%s, %s, %s){left_out})")
    return statement


def _round_deadlines_moved(rnd: Round, now: datetime, *, unit: WorkUnit, written: tuple) -> None:
    """After _round_arrival_statement has committed: `rnd` (the round as its lock found it, before the arrival)
    given the arrival, as the database now has it, and its deadlines moved to what the arrivals say. `written`: the
    deadlines that statement left. Only when they differ (the first arrival, or a median pace that moved: a few
    arrivals of a round) does a statement of its own write them, outside the round's lock; it writes nothing when a
    later arrival has counted itself since (the later one's deadlines stand). Committed without waiting for the
    disk: the deadlines are recomputed from the statistic at every arrival, so one lost in a crash costs nothing."""
    _arrived(rnd, now, unit)
    if (rnd.deadline_at, rnd.close_at) == tuple(written):
        return
    vendor = "" if connection.in_atomic_block else connection.vendor
    sql.execute(_deadlines_sql(vendor), [sql.value(Round, "deadline_at", rnd.deadline_at),
                                         sql.value(Round, "close_at", rnd.close_at), rnd.pk, rnd.arrivals])


@functools.cache
def _deadlines_sql(unflushed_on: str) -> str:
    return (f"UPDATE {sql.table(Round)} SET {_column('deadline_at')} = %s, {_column('close_at')} = %s "
            f"WHERE id = %s AND {_column('arrivals')} = %s{sql.unflushed_returning(unflushed_on)}")


_RESCHEDULED = ("arrivals", "latest_arrival_seconds", "arrival_paces", "deadline_at", "close_at")
_UNFINISHED = (WorkUnit.Status.QUEUED, WorkUnit.Status.LEASED, WorkUnit.Status.VERIFYING)


@functools.cache
def _reschedule_sql(*, complete: bool, cancelled: bool = False) -> str:
    """The round's running statistic and deadlines, written once (muninn/sql.py: why): every result runs it. With
    `complete`, it returns _round_complete's answer too, which sees this transaction's own writes (the unit just
    accepted); `cancelled`: leaving out the units of a WITH named so."""
    name = connection.ops.quote_name
    columns = ", ".join(f"{name(Round._meta.get_field(f).column)} = %s" for f in _RESCHEDULED)
    statement = f"UPDATE {sql.table(Round)} SET {columns} WHERE id = %s"
    if complete:
        left_out = " AND id NOT IN (SELECT id FROM cancelled)" if cancelled else ""
        statement += (f" RETURNING NOT EXISTS (SELECT 1 FROM {sql.table(WorkUnit)} WHERE round_id = %s "
                      f"AND status IN (%s, %s, %s){left_out})")
    return statement


def rounds_overdue(*, now: datetime | None = None) -> list[int]:
    """Open rounds past their hard deadline that have at least one verified update: ready to close as they
    are (a round with none waits: it never closes empty). A round with results still being re-executed waits
    for them: they arrived in time, and only our side is slow."""
    now = now or timezone.now()
    return list(
        Round.objects.filter(Q(close_at__lt=now) | Q(close_at__isnull=True, deadline_at__lt=now),
                             status=Round.Status.OPEN, units__status=WorkUnit.Status.ACCEPTED)
        .exclude(units__status=WorkUnit.Status.VERIFYING)
        .values_list("id", flat=True).distinct()
    )


def rounds_stalled(*, now: datetime | None = None) -> list[int]:
    """Open rounds whose every unit is done (accepted, or cancelled, with at least one accepted) and whose last
    result came in more than MUNINN_STALL_SECONDS ago, yet were never aggregated: the aggregation's message was
    lost (a broker restarted) or the worker running it was killed (its unacknowledged message comes back only
    after the broker's visibility timeout). Aggregating them again is safe: round_aggregate is idempotent."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.MUNINN_STALL_SECONDS)
    busy = [WorkUnit.Status.QUEUED, WorkUnit.Status.LEASED, WorkUnit.Status.VERIFYING]
    return list(
        Round.objects.filter(status=Round.Status.OPEN, job__status=Job.Status.RUNNING)
        .exclude(units__status__in=busy)
        .annotate(last_accepted=Max("units__accepted_at"))
        .filter(last_accepted__lt=cutoff).order_by("id").values_list("id", flat=True)
    )


def jobs_stalled(*, now: datetime | None = None) -> list[int]:
    """Running jobs with rounds still to go and no open round for more than MUNINN_STALL_SECONDS: the message that
    opens the first round (job_start's) was lost with a broker restart, or the worker that closed the last round
    died before opening the next. Opening it again is safe: round_open is idempotent."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.MUNINN_STALL_SECONDS)
    return list(
        Job.objects.filter(status=Job.Status.RUNNING, current_round__lt=F("rounds"), started_at__lt=cutoff)
        .exclude(round_set__status=Round.Status.OPEN).exclude(round_set__closed_at__gte=cutoff)
        .order_by("id").values_list("id", flat=True)
    )


def _round_complete(rnd: Round) -> bool:
    """No unit of the round is queued, leased or verifying (one fixed statement: every result asks it)."""
    return sql.fetch_one(f"SELECT 1 FROM {sql.table(WorkUnit)} WHERE round_id = %s AND status IN (%s, %s, %s) LIMIT 1",
                         [rnd.pk, *_UNFINISHED]) is None


def round_locked(round_id: int) -> Round:
    """The round, its row locked for the caller's transaction (where the database locks rows)."""
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    row = sql.fetch_one(f"SELECT {sql.columns(Round)} FROM {sql.table(Round)} WHERE id = %s{lock}", [round_id])
    if row is None:
        raise Round.DoesNotExist(f"There is no round {round_id}.")
    return sql.instance(Round, row)
