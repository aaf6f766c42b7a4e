"""A job's life (planned, created, started, ended) and its maths: what a unit of it costs, its model."""
from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

import torch
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from muninn_worker import datasets, preparation, tensors, training, zoo
from muninn_worker.federated import algorithms
from muninn_worker.federated.plan import holdout, initial_state

from muninn.errors import Conflict, InvalidInput

from .. import estimate, selectors, storage
from ..models import Dataset, Job, Round, WorkUnit
from ..signals import job_ended, job_ending, job_started

from .datasets import _load_samples, _xy_bytes, load_xy

log = logging.getLogger(__name__)


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
    see muninn_worker.federated.algorithms); missing ones take their defaults."""
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
    X_train, y_train, X_test, y_test = holdout(X, y, seed=seed)
    # Data-derived buffers (feature scaling, a regression target's scale) travel inside the model, so the
    # downloaded model takes raw inputs and answers in the customer's units.
    state = initial_state(template, plan.model_config, seed=seed, X_train=X_train, y_train=y_train)
    est = plan.estimate
    key = selectors.dataset_key(dataset)  # a sensitive dataset's splits are sealed as its upload is
    with transaction.atomic():
        return Job.objects.create(
            owner=owner, dataset=dataset, template=template, hparams=plan.hparams, model_config=plan.model_config,
            base_weights=base_weights, aggregation=aggregation, backends=",".join(plan.backends),
            **plan.scheme.fields(),
            rounds=rounds, seed=seed, flops_per_sample=est.flops_per_sample, flops_estimated=est.flops_total,
            forward_flops_per_sample=est.forward_flops_per_sample,
            peak_memory_bytes=est.peak_memory_bytes,
            train_sha256=storage.data_put(_xy_bytes(X_train, y_train), key=key),
            test_sha256=storage.data_put(_xy_bytes(X_test, y_test), key=key),
            n_train=len(y_train), n_test=len(y_test),
            global_weights_sha256=storage.blob_put(tensors.state_dict_to_bytes(state)),
            metrics=metadata,
        )


def job_start(*, job_id: int, quote: str | None = None) -> Job:
    """Created → running. Receivers of `job_started` (billing accepts the quote and places the hold) run in this
    transaction and may refuse. `quote` is the id of the quote the customer accepts, passed on untouched."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.status != Job.Status.CREATED:
            raise Conflict(f"Job {job.pk} is {job.status}; only a created job can be started.", code="not_startable")
        job.status, job.started_at = Job.Status.RUNNING, timezone.now()
        job.save(update_fields=["status", "started_at"])
        job_started.send(sender=Job, job=job, quote=quote)  # and jobs.tasks opens round 1 once this commits
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


def unit_flops(job: Job, samples: int) -> int:
    """A unit's FLOPs, as the estimate counts them: its training passes and the receipt's two evaluations."""
    return estimate.unit_flops(flops_per_sample=job.flops_per_sample, samples=samples, epochs=job.hparams["epochs"],
                               forward_flops_per_sample=job.forward_flops_per_sample, inner_steps=job.inner_steps,
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
    X_test, y_test = load_xy(job.test_sha256, key=selectors.job_data_key(job))
    return training.evaluate(job_model(job, state), X_test, y_test)
