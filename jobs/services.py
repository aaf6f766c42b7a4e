"""Writes on datasets, jobs, rounds and work units. Views and tasks are thin doors into these."""
from __future__ import annotations

import logging
import math
import secrets
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import torch
from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Max, Q
from django.utils import timezone
from muninn_worker import flops as worker_flops
from muninn_worker import tensors, training, zoo

from muninn.errors import Conflict, InvalidInput, TooLarge
from muninn.failpoints import failpoint

from . import algorithms, datasets, deadlines, estimate, preparation, robust, selectors, storage, wakeups
from .models import Dataset, Job, Round, WorkUnit
from .shards import shards_to_bytes
from .sharding import plan_shards
from .signals import job_ended, job_ending, job_started

log = logging.getLogger(__name__)


# --- Datasets -------------------------------------------------------------------------------------

def dataset_create(*, owner, filename: str, data: bytes, name: str = "", target: str = "", task: str = "",
                   tokenizer: str = "") -> Dataset:
    """Validate, profile and store an upload. Nothing is stored unless the whole file is valid.

    `task` forces a table's target to "classification" or "regression" (default: detected); `tokenizer` is
    "char" (default) or "byte" for text."""
    if len(data) > settings.MUNINN_MAX_UPLOAD_BYTES:
        raise TooLarge(f"The file is {len(data):,} bytes; the limit is {settings.MUNINN_MAX_UPLOAD_BYTES:,}.")
    if not data:
        raise InvalidInput("The file is empty.", code="empty_file")
    try:
        fmt = datasets.sniff_format(filename, data[:4096])
        parsed = datasets.parse_dataset(data, fmt, target=target or None, task=task or None,
                                        tokenizer=tokenizer or None)
    except datasets.DatasetError as e:
        raise InvalidInput(e.message, code=e.code, detail=e.detail) from e
    sha = storage.blob_put(data)
    return Dataset.objects.create(
        owner=owner, name=(name or filename)[:200], sha256=sha, size_bytes=len(data), format=fmt,
        target=target, profile=parsed.profile,
    )


def _load_samples(dataset: Dataset, model_config: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The dataset as (X, y) samples for this model, read exactly as at upload, and the job's metadata."""
    options = preparation.parse_options(dataset.profile, model_config)
    parsed = datasets.parse_dataset(storage.blob_get(dataset.sha256), dataset.format, target=dataset.target or None,
                                    **options)
    X, y = preparation.samples(parsed, model_config)
    return X, y, preparation.job_metadata(parsed.profile)


def _xy_bytes(X: torch.Tensor, y: torch.Tensor) -> bytes:
    return tensors.shard_to_bytes(X.contiguous(), y.contiguous())


def load_xy(sha256: str) -> tuple[torch.Tensor, torch.Tensor]:
    return tensors.bytes_to_shard(storage.blob_get(sha256))


# --- Jobs -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobPlan:
    hparams: dict
    model_config: dict
    estimate: estimate.Estimate
    base_weights: Dataset | None = None
    backends: tuple[str, ...] = ("cpu",)
    scheme: algorithms.Scheme = algorithms.Scheme()


def template_backends(template: str) -> tuple[str, ...]:
    """Where the worker client trains this template's units: GPU-tier templates on CUDA, the rest on the CPU
    (which every device has; small models train faster there than through a GPU's launch overheads)."""
    return ("cuda",) if zoo.get_template(template).tier == "gpu" else ("cpu",)


def job_plan(*, dataset: Dataset, template: str, hparams: dict, rounds: int,
             base_weights: Dataset | None = None, training: dict | None = None) -> JobPlan:
    """Validate a customer's choice and count its work, writing nothing (the estimate shown before paying).

    The model_config comes from the template and the dataset's profile; `base_weights` (a "weights" dataset
    of the same owner) is required by templates that fine-tune uploaded weights (lora) and refused by others.
    `training` holds the algorithm settings (algorithm, outer_lr, outer_momentum, inner_steps, update_encoding;
    see jobs.algorithms); missing ones take their defaults."""
    if not 1 <= rounds <= settings.MUNINN_MAX_ROUNDS:
        raise InvalidInput(f"rounds must be between 1 and {settings.MUNINN_MAX_ROUNDS}.", code="bad_rounds")
    try:
        scheme = algorithms.scheme(**(training or {}))
    except algorithms.InvalidScheme as e:
        raise InvalidInput(str(e), code="bad_algorithm", detail={"field": e.field}) from e
    try:
        spec = zoo.get_template(template)
        hp = zoo.validate_hparams(template, hparams or {})
    except zoo.InvalidHParams as e:
        raise InvalidInput(str(e), code="bad_hparams", detail={"field": e.field}) from e
    except ValueError as e:  # UnknownTemplate
        raise InvalidInput(str(e), code="bad_hparams") from e
    profile = dataset.profile
    if profile.get("kind") == "weights":
        raise InvalidInput(f"Dataset {dataset.pk} holds model weights, not training data; pass it as base_weights "
                           "of a lora job.", code="incompatible_data")
    if spec.needs_base and base_weights is not None:
        if base_weights.profile.get("kind") != "weights":
            raise InvalidInput(f"base_weights must be a .safetensors upload; dataset {base_weights.pk} is "
                               f"{base_weights.format}.", code="incompatible_data")
        profile = {**profile, "base_model_config": base_weights.profile["model_config"]}
    elif base_weights is not None:
        raise InvalidInput(f"The {template} template trains from scratch; base_weights are for lora.",
                           code="incompatible_data")
    try:
        model_config = zoo.model_config_for(template, profile, hp)
    except zoo.InvalidHParams as e:
        raise InvalidInput(str(e), code="bad_hparams", detail={"field": e.field}) from e
    except zoo.IncompatibleData as e:
        raise InvalidInput(str(e), code="incompatible_data") from e
    rows = preparation.sample_count(profile, model_config)
    too_large = preparation.decoded_too_large(profile, model_config, rows)
    if too_large:
        raise InvalidInput(too_large, code="too_large", detail={"field": "image_size"})
    if rows < datasets.MIN_ROWS:
        raise InvalidInput(f"This dataset gives {rows} training samples for this model; at least "
                           f"{datasets.MIN_ROWS} are needed (for text: a shorter context, or more text).",
                           code="too_few_rows")
    train_idx, _ = datasets.split_holdout(rows, seed=0)  # the split's sizes do not depend on the seed
    est = estimate.job_estimate(template=template, model_config=model_config, hparams=hp,
                                n_train=len(train_idx), rounds=rounds, inner_steps=scheme.inner_steps)
    return JobPlan(hp, model_config, est, base_weights, template_backends(template), scheme)


def job_create(*, owner, dataset: Dataset, template: str, hparams: dict, rounds: int,
               seed: int | None = None, base_weights: Dataset | None = None,
               aggregation: str = Job.Aggregation.FEDAVG, training: dict | None = None) -> Job:
    """Plan the job, split the data once (fixed seed), and make the initial model. `training`: see job_plan."""
    plan = job_plan(dataset=dataset, template=template, hparams=hparams, rounds=rounds, base_weights=base_weights,
                    training=training)
    seed = secrets.randbelow(2**31) if seed is None else seed
    try:
        X, y, metadata = _load_samples(dataset, plan.model_config)
    except datasets.DatasetError as e:  # e.g. a zip of images that does not decode at the chosen size
        raise InvalidInput(e.message, code=e.code, detail=e.detail) from e
    train_idx, test_idx = datasets.split_holdout(len(y), seed=seed)
    X_train, y_train, X_test, y_test = X[train_idx], y[train_idx], X[test_idx], y[test_idx]
    # Data-derived buffers (feature scaling, a regression target's scale) travel inside the model, so the
    # downloaded model takes raw inputs and answers in the customer's units.
    state = zoo.get_template(template).fit_state(zoo.init_state(template, plan.model_config, seed), X_train, y_train)
    est = plan.estimate
    with transaction.atomic():
        return Job.objects.create(
            owner=owner, dataset=dataset, template=template, hparams=plan.hparams, model_config=plan.model_config,
            base_weights=base_weights, aggregation=aggregation, backends=",".join(plan.backends),
            **plan.scheme.fields(),
            rounds=rounds, seed=seed, flops_per_sample=est.flops_per_sample, flops_estimated=est.flops_total,
            forward_flops_per_sample=est.forward_flops_per_sample,
            peak_memory_bytes=est.peak_memory_bytes,
            train_sha256=storage.blob_put(_xy_bytes(X_train, y_train)),
            test_sha256=storage.blob_put(_xy_bytes(X_test, y_test)),
            n_train=len(train_idx), n_test=len(test_idx),
            global_weights_sha256=storage.blob_put(tensors.state_dict_to_bytes(state)),
            metrics=metadata,
        )


def job_start(*, job_id: int, quote: str | None = None) -> Job:
    """Created → running. Receivers of `job_started` (billing accepts the quote and places the hold) run in this
    transaction and may refuse. `quote` is the id of the quote the customer accepts, passed on untouched."""
    from .tasks import open_round  # tasks import services; the reverse import is deferred

    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.status != Job.Status.CREATED:
            raise Conflict(f"Job {job.pk} is {job.status}; only a created job can be started.", code="not_startable")
        job.status, job.started_at = Job.Status.RUNNING, timezone.now()
        job.save(update_fields=["status", "started_at"])
        job_started.send(sender=Job, job=job, quote=quote)
        transaction.on_commit(lambda: open_round.delay(job.pk))
    return job


def _job_end(job: Job, status: str, error: str = "") -> None:
    """Must run inside a transaction holding the job's row lock."""
    job_ending.send(sender=Job, job=job)
    job.status, job.error, job.finished_at = status, error, timezone.now()
    job.save(update_fields=["status", "error", "finished_at"])
    WorkUnit.objects.filter(round__job=job, status__in=[WorkUnit.Status.QUEUED, WorkUnit.Status.LEASED]).update(
        status=WorkUnit.Status.CANCELLED, lease_token=None, lease_expires_at=None)
    job.round_set.filter(status=Round.Status.OPEN).update(status=Round.Status.CLOSED, closed_at=timezone.now())
    job_ended.send(sender=Job, job=job)


def job_cancel(*, job_id: int) -> Job:
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.is_ended:
            raise Conflict(f"Job {job.pk} has already ended ({job.status}).", code="job_ended")
        _job_end(job, Job.Status.CANCELLED)
    return job


def job_fail(*, job_id: int, error: str) -> None:
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if not job.is_ended:
            _job_end(job, Job.Status.FAILED, error)


# --- Rounds ---------------------------------------------------------------------------------------

def _unit_seed(job: Job, number: int, index: int) -> int:
    return (job.seed * 1_000_003 + number * 10_007 + index) % 2**31


def round_open(*, job_id: int, devices: Sequence[tuple[int, float]]) -> Round | None:
    """Open the job's next round: shard the training set across the capable devices online now, given as
    (device id, measured FLOP/s): sizes ∝ throughput so they finish together, each shard reserved for a
    while for the device it was sized for; no device or one device → one unit with everything. The
    deadlines come from the plan (jobs/deadlines.py). Idempotent: an open round is returned as it is; an
    ended job or a finished schedule opens nothing. Built for markets of 10,000 devices: the shards are cut
    from the training set's bytes and written straight (jobs/shards.py, storage.blobs_put), and the
    units go in as plain rows (_units_insert)."""
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
        X, y = load_xy(job.train_sha256)
        shards = plan_shards(job.n_train, [speed for _, speed in devices],
                             min_shard=min(job.hparams["batch_size"], job.n_train))
        now = timezone.now()
        reserved_until = now + timedelta(seconds=settings.MUNINN_RESERVATION_SECONDS)
        shard_shas = storage.blobs_put(shards_to_bytes(X, y, [(s.start, s.stop) for s in shards]))
        flops_of: dict[int, int] = {}  # shards of one size cost the same: most of a large round's sizes repeat
        rows = []
        for i, shard in enumerate(shards):
            samples = shard.stop - shard.start
            if samples not in flops_of:
                flops_of[samples] = unit_flops(job, samples)
            flops = flops_of[samples]
            planned = shard.device is not None
            rows.append((i, shard.start, shard.stop, shard_shas[i], _unit_seed(job, number, i), flops,
                         deadlines.expected_seconds(flops, devices[shard.device][1]) if planned else 0.0,
                         devices[shard.device][0] if planned else None, reserved_until if planned else None))
        plan = deadlines.plan_of(row[6] for row in rows)
        soft, hard = _deadlines(plan=plan, arrivals=deadlines.Arrivals())
        rnd = Round.objects.create(job=job, number=number, weights_sha256=job.global_weights_sha256, opened_at=now,
                                   deadline_at=now + timedelta(seconds=soft), close_at=now + timedelta(seconds=hard),
                                   plan_seconds=plan.slowest, plan_complete=plan.complete)
        _units_insert(common={"round": rnd, "min_memory_bytes": job.peak_memory_bytes}, fields=_PLANNED_FIELDS,
                      rows=rows)
        job.current_round = number
        job.save(update_fields=["current_round"])
    log.info("job %s: opened round %s with %s unit(s)", job.pk, number, len(shards))
    return rnd


# What differs between the units round_open plans, in the order of its rows.
_PLANNED_FIELDS = ("index", "shard_start", "shard_stop", "shard_sha256", "seed", "flops", "expected_seconds",
                   "preferred_device_id", "reserved_until")


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
            "train_loss": sum(u.result_metrics.get("loss_after", 0.0) * n for u, n in zip(accepted, samples))
            / sum(samples),
            "samples": sum(samples),
            "units": len(accepted),
        }
        rnd.units.filter(status__in=[WorkUnit.Status.QUEUED, WorkUnit.Status.LEASED]).update(
            status=WorkUnit.Status.CANCELLED, lease_token=None, lease_expires_at=None)
        rnd.status, rnd.closed_at = Round.Status.CLOSED, timezone.now()
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
    rule = job.aggregation
    if rule == Job.Aggregation.TRIMMED_MEAN and len(states) < 5:
        rule = Job.Aggregation.MEDIAN if len(states) >= 3 else Job.Aggregation.FEDAVG
    return robust.aggregate(rule, states, samples, global_state)


def diverging_message(job: Job, round_number: int) -> str:
    """What a customer whose training diverges is told: the job's fault, with what to change."""
    lr = job.hparams.get("lr")
    if not isinstance(lr, (int, float)):
        return "Training diverges: the loss became infinite or NaN. Lower the learning rate and start a new job."
    return (f"Training diverges: the loss became infinite or NaN in round {round_number} with learning rate "
            f"{lr:g}. Lower the learning rate (try {lr / 10:g}) and start a new job; the unused part of the hold "
            f"was released.")


def job_scheme(job: Job) -> algorithms.Scheme:
    return algorithms.Scheme(job.algorithm, job.outer_lr, job.outer_momentum, job.inner_steps, job.update_encoding)


def unit_train_spec(unit: WorkUnit) -> dict:
    """How a unit is trained: the arguments of `training.train_local`, the same for the device that does
    the work and for the validator that re-executes it (DiLoCo: `inner_steps` steps instead of epochs)."""
    job = unit.round.job
    hp = job.hparams
    return {"epochs": hp["epochs"], "batch_size": hp["batch_size"], "lr": hp["lr"],
            "momentum": hp.get("momentum", 0.0), "seed": unit.seed,
            "optimizer": zoo.get_template(job.template).optimizer, "inner_steps": job.inner_steps}


def unit_flops(job: Job, samples: int) -> int:
    """A unit's FLOPs, as the estimate counts them: its training passes and the receipt's two evaluations."""
    return estimate.unit_flops(flops_per_sample=job.flops_per_sample, samples=samples, epochs=job.hparams["epochs"],
                               forward_flops_per_sample=job.forward_flops_per_sample, inner_steps=job.inner_steps,
                               batch_size=job.hparams["batch_size"])


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


def job_model(job: Job, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The job's model with these weights (and, for LoRA, the customer's frozen base under them)."""
    model = zoo.build_model(job.template, job.model_config)
    model.load_state_dict(state)
    if job.base_weights_id is not None:
        zoo.load_base(model, tensors.bytes_to_state_dict(storage.blob_get(job.base_weights.sha256)))
    return model


def _evaluate(job: Job, state: dict[str, torch.Tensor]) -> dict[str, float]:
    """The template's metrics on the held-out split: accuracy, RMSE or perplexity, and the loss."""
    X_test, y_test = load_xy(job.test_sha256)
    return training.evaluate(job_model(job, state), X_test, y_test)


def _deadlines(*, plan: deadlines.Plan, arrivals: deadlines.Arrivals) -> deadlines.Deadlines:
    return deadlines.deadlines(
        plan=plan, arrivals=arrivals, grace=settings.MUNINN_ROUND_GRACE_SECONDS,
        floor=settings.MUNINN_ROUND_DEADLINE_MIN_SECONDS, ceiling=settings.MUNINN_ROUND_DEADLINE_SECONDS)


def _round_arrivals(rnd: Round) -> deadlines.Arrivals:
    """The round's running statistic of its arrivals, as jobs/deadlines.py reads it."""
    return deadlines.Arrivals(rnd.arrivals, rnd.latest_arrival_seconds,
                              {int(bucket): n for bucket, n in rnd.arrival_paces.items()})


def _round_reschedule(rnd: Round, now: datetime, *, unit: WorkUnit | None = None) -> None:
    """A result for `unit` arrived `now`: add it to the round's running statistic and move the deadlines to
    what the arrivals so far say, in constant time whatever the round's size (the caller holds the round's
    lock). Every result that arrives counts once, its unit's planned seconds giving its pace: a backup's
    arrival stands for its original's plan (a backup is a copy of it), and a result rejected later keeps the
    pace it showed (it arrived then; the cheap checks refused implausible times before it got here; the median
    shrugs off a few odd ones). Without `unit`, the unit whose result arrived `now` is looked up."""
    if unit is None:
        unit = rnd.units.filter(submitted_at=now).order_by("id").first()
    seen = _round_arrivals(rnd)
    if unit is not None:
        seen = seen.add(deadlines.Arrival((now - rnd.opened_at).total_seconds(), unit.expected_seconds))
    soft, hard = _deadlines(plan=deadlines.Plan(rnd.plan_seconds, rnd.plan_complete), arrivals=seen)
    rnd.arrivals, rnd.latest_arrival_seconds = seen.count, seen.latest
    rnd.arrival_paces = {str(bucket): n for bucket, n in sorted(seen.paces.items())}
    rnd.deadline_at = rnd.opened_at + timedelta(seconds=soft)
    rnd.close_at = rnd.opened_at + timedelta(seconds=hard)
    rnd.save(update_fields=["arrivals", "latest_arrival_seconds", "arrival_paces", "deadline_at", "close_at"])


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


def units_reissue_stragglers(*, now: datetime | None = None) -> list[int]:
    """Past an open round's soft deadline, each unit still leased (a straggler) is issued once more, as a
    backup unit open to any free device; whichever of the two gives the first valid result is accepted
    and the other is cancelled (see unit_accept). Idempotent: a unit gets at most one backup. Returns the
    backups' ids."""
    now = now or timezone.now()
    created = []
    for round_id in (Round.objects.filter(status=Round.Status.OPEN, deadline_at__lt=now, job__status=Job.Status.RUNNING)
                     .values_list("id", flat=True)):
        with transaction.atomic():
            rnd = Round.objects.select_for_update().get(pk=round_id)
            if rnd.status != Round.Status.OPEN:
                continue
            stragglers = list(rnd.units.filter(status=WorkUnit.Status.LEASED, backup_of__isnull=True,
                                               backups__isnull=True))
            if not stragglers:
                continue
            next_index = (rnd.units.order_by("-index").values_list("index", flat=True).first() or 0) + 1
            backups = WorkUnit.objects.bulk_create([
                WorkUnit(round=rnd, index=next_index + i, backup_of=unit, shard_start=unit.shard_start,
                         shard_stop=unit.shard_stop, shard_sha256=unit.shard_sha256, seed=unit.seed, flops=unit.flops,
                         min_memory_bytes=unit.min_memory_bytes, expected_seconds=unit.expected_seconds)
                for i, unit in enumerate(stragglers)
            ])
            created += [b.pk for b in backups]
        log.info("job round %s: re-issued %s straggler unit(s)", round_id, len(stragglers))
    return created


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


# --- Work units -----------------------------------------------------------------------------------

def _runnable_on(resources: dict[str, int]) -> Q:
    """Units a device can run: one of its backends is among the job's, with the unit's memory on it.
    `resources` maps each backend the device offers ("cpu", "cuda", "mps") to its memory in bytes."""
    runnable = Q(pk__in=[])
    for backend, memory in resources.items():
        runnable |= Q(round__job__backends__contains=backend, min_memory_bytes__lte=memory)
    return runnable


def unit_lease(*, device_id: int, resources: dict[str, int], lease_seconds: int | None = None) -> WorkUnit | None:
    """Lease one queued unit the device can run (see _runnable_on): first one sized for it, then a
    straggler's backup (the round waits on it), then one nobody else has reserved; never a unit in its backoff
    after a refusal (nor, for a minute more, one refused from this device); never the backup of a
    unit this device is itself running. Never the same unit to two devices: rows are locked with SKIP
    LOCKED where the database has it, and the lease itself is a conditional update on the status.
    Returns the unit with its round and job loaded."""
    lease_seconds = lease_seconds or settings.MUNINN_LEASE_SECONDS
    now = timezone.now()
    queued = WorkUnit.objects.filter(
        _runnable_on(resources), Q(not_before__isnull=True) | Q(not_before__lte=now),
        status=WorkUnit.Status.QUEUED, round__status=Round.Status.OPEN, round__job__status=Job.Status.RUNNING,
    ).exclude(backup_of__leased_device_id=device_id).exclude(
        refused_device_id=device_id,
        not_before__gt=now - timedelta(seconds=settings.MUNINN_UNIT_BACKOFF_MAX_SECONDS))
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
                unit = _lease_first(candidates, token=uuid.uuid4(), **lease)
            else:
                unit_id = _lease_one_of(candidates[:4], token=uuid.uuid4(), **lease)
                unit = None if unit_id is None else WorkUnit.objects.get(pk=unit_id)
            if unit is not None:
                unit.round = selectors.round_fixed(unit.round_id)
                return unit
    return None


def _lease_first(candidates, *, token: uuid.UUID, status: str, leased_device_id: int,
                 lease_expires_at) -> WorkUnit | None:
    """PostgreSQL: lease the first candidate no other claim holds, in one statement (a queue's UPDATE ... WHERE id
    = (SELECT ... FOR UPDATE SKIP LOCKED LIMIT 1) RETURNING the leased row)."""
    pick, params = candidates.select_for_update(skip_locked=True, of=("self",)).values("id")[:1].query.sql_with_params()
    table = WorkUnit._meta.db_table
    leased = WorkUnit.objects.raw(
        f'UPDATE "{table}" SET status = %s, lease_token = %s, leased_device_id = %s, lease_expires_at = %s, '
        f'attempts = attempts + 1 WHERE id = ({pick}) AND status = %s RETURNING *',
        [status, token, leased_device_id, lease_expires_at, *params, WorkUnit.Status.QUEUED])
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
    rnd = Round.objects.select_for_update().get(pk=unit.round_id)
    now = timezone.now()
    fields = {"status": WorkUnit.Status.VERIFYING if verify else WorkUnit.Status.ACCEPTED,
              "accepted_at": None if verify else now, "result_sha256": result_sha256, "result_samples": samples,
              "result_metrics": metrics, "lease_expires_at": None, "submitted_at": now}
    # One conditional update: still leased to this lease, in a round still open (the round's lock is held).
    if rnd.status != Round.Status.OPEN or not WorkUnit.objects.filter(
            pk=unit_id, status=WorkUnit.Status.LEASED, lease_token=lease_token).update(**fields):
        _refuse_accept(WorkUnit.objects.get(pk=unit_id), rnd)
    for field, value in fields.items():
        setattr(unit, field, value)
    if not verify:
        _cancel_copies(unit)
    if unit.backup_of_id is not None:  # a backup's arrival stands for its original's
        WorkUnit.objects.filter(pk=unit.backup_of_id, submitted_at__isnull=True).update(submitted_at=now)
    job = unit.round.job
    _round_reschedule(rnd, now, unit=unit)
    rnd.job = job
    unit.round = rnd
    return unit, _round_complete(rnd)


def _refuse_accept(unit: WorkUnit, rnd: Round) -> None:
    """Why a result for this unit cannot be accepted now (always raises Conflict)."""
    if unit.status in (WorkUnit.Status.ACCEPTED, WorkUnit.Status.VERIFYING):
        raise Conflict("This unit already has a result.", code="already_done")
    if unit.status == WorkUnit.Status.CANCELLED and rnd.status == Round.Status.OPEN:
        raise Conflict(SUPERSEDED, code="superseded")
    raise Conflict("This unit is no longer leased to you (the lease expired or the round closed).",
                   code="lease_lost")


def _cancel_copies(unit: WorkUnit) -> int:
    """The other copies of an accepted unit's shard (its original or backups) will not count: cancel them,
    so their late results are refused and the round need not wait for them."""
    group = unit.backup_of_id or unit.pk
    return (WorkUnit.objects.filter(Q(pk=group) | Q(backup_of_id=group)).exclude(pk=unit.pk)
            .exclude(status=WorkUnit.Status.ACCEPTED)
            .update(status=WorkUnit.Status.CANCELLED, lease_token=None, lease_expires_at=None))


def _round_complete(rnd: Round) -> bool:
    return not rnd.units.filter(
        status__in=[WorkUnit.Status.QUEUED, WorkUnit.Status.LEASED, WorkUnit.Status.VERIFYING]).exists()


def unit_verified(*, unit_id: int) -> tuple[WorkUnit, bool]:
    """A re-execution agreed: the verifying result now counts. Returns (unit, round_complete)."""
    rnd = Round.objects.select_for_update().get(pk=WorkUnit.objects.values("round_id").get(pk=unit_id)["round_id"])
    unit = WorkUnit.objects.select_for_update().get(pk=unit_id)
    if unit.status == WorkUnit.Status.CANCELLED:
        raise Conflict(SUPERSEDED, code="superseded")
    if unit.status != WorkUnit.Status.VERIFYING:
        raise Conflict(f"Unit {unit_id} is {unit.status}, not verifying.", code="not_verifying")
    unit.status, unit.accepted_at = WorkUnit.Status.ACCEPTED, timezone.now()
    unit.save(update_fields=["status", "accepted_at"])
    _cancel_copies(unit)
    unit.round = rnd
    return unit, rnd.status == Round.Status.OPEN and _round_complete(rnd)


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


def units_requeue_expired(*, now: datetime | None = None) -> int:
    """Leases past their expiry go back to the queue, open to any device (a new lease gets a new token, so
    a late result from the old holder is refused). Safe to run any number of times."""
    return WorkUnit.objects.filter(
        status=WorkUnit.Status.LEASED, lease_expires_at__lt=now or timezone.now(),
    ).update(status=WorkUnit.Status.QUEUED, lease_token=None, lease_expires_at=None, preferred_device_id=None,
             reserved_until=None)


# --- Waiting for a capable device ------------------------------------------------------------------

def jobs_check_waiting(*, capacity_for: Callable[..., dict], now: datetime | None = None) -> list[int]:
    """No job waits forever. Each running job's wait clock (Job.waiting_since) starts when beat first finds no
    capable device online and unquarantined (selectors.job_waiting: devices busy with other work count as
    capable) and stops when one is back; a job whose clock reaches MUNINN_JOB_WAIT_LIMIT fails with the reason,
    and job_fail's job_ended receivers release its unused hold. `capacity_for` is
    contributors.selectors.capacity_for, passed in by the task layer. Returns the ids of the jobs it failed.
    Safe to run any number of times; the clock only runs while beat looks, so a beat that was down starts it
    late, never early."""
    now = now or timezone.now()
    limit = settings.MUNINN_JOB_WAIT_LIMIT
    asked: dict[tuple, dict] = {}

    def capacity(*, min_memory_bytes: int, backends) -> dict:  # jobs with the same needs ask once per sweep
        key = (min_memory_bytes, tuple(backends))
        if key not in asked:
            asked[key] = capacity_for(min_memory_bytes=min_memory_bytes, backends=backends)
        return asked[key]

    failed = []
    for job in Job.objects.filter(status=Job.Status.RUNNING).order_by("id"):
        waiting = selectors.job_waiting(job, capacity)
        running = Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING)
        if waiting is None or not waiting.without_device:
            if job.waiting_since is not None:
                running.update(waiting_since=None)
        elif job.waiting_since is None:
            running.update(waiting_since=now)
        elif (now - job.waiting_since).total_seconds() >= limit:
            log.warning("job %s: no capable device since %s; failing it", job.pk, job.waiting_since)
            job_fail(job_id=job.pk, error=selectors.job_wait_limit_error(job, waiting, waited_seconds=limit))
            failed.append(job.pk)
    return failed
