"""A whole job in one process, as the platform would run it: `muninn-worker simulate`.

Every step is the platform's own code, called the same way (muninn_worker.federated.plan says which):

  job       the dataset parsed and prepared as the site reads an upload (`datasets`, `preparation`), the held-out
            split with the job's seed, the initial weights with their data-derived buffers;
  round r   shards of the training split planned for N devices of equal speed (`plan.round_shards`: sizes ∝
            throughput, so equal here), unit i trained with seed `plan.unit_seed(seed, r, i)` and the template's
            training arguments (`training.train_local`), its update encoded as a device sends it and decoded as
            the site reads it (`codec`), the updates combined with the job's rule (`robust`, weighted by samples)
            and the next global weights taken (`algorithms.next_global`: FedAvg, or DiLoCo's outer step);
            the model evaluated on the held-out split (`training.evaluate`).

With the same dataset, template, hyper-parameters, rounds and seed, and N devices that the site sees as equally
fast, a simulated job's weights and metrics are the platform's, bit for bit (tests/test_simulate_matches.py).
On the platform, later rounds size shards by each device's measured speed, so mixed hardware moves the numbers
a little. `non_iid` replaces the platform's partition with a label-skewed one (`federated.partition`).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from muninn_worker import codec, datasets, preparation, tensors, training, zoo
from muninn_worker.federated import algorithms, plan, robust
from muninn_worker.federated.partition import dirichlet_split

__all__ = ["SimulationError", "Job", "RoundReport", "job_prepare", "simulate", "METRICS"]

# The headline metric of each task, as the site shows it.
METRICS = {"classification": "accuracy", "regression": "rmse", "language_model": "perplexity"}


class SimulationError(ValueError):
    """A choice the simulation cannot run (the same ones the site refuses), with a sentence saying why."""


@dataclass(frozen=True)
class Job:
    """A job as the site would create it: its prepared splits, initial weights and settings."""

    template: str
    hparams: dict
    model_config: dict
    scheme: algorithms.Scheme
    aggregation: str
    seed: int
    X_train: torch.Tensor
    y_train: torch.Tensor
    X_test: torch.Tensor
    y_test: torch.Tensor
    initial_state: dict[str, torch.Tensor]

    @property
    def task(self) -> str:
        return zoo.task_of(self.template, self.model_config)

    @property
    def metric(self) -> str:
        return METRICS[self.task]


@dataclass
class RoundReport:
    round: int
    metrics: dict[str, float]  # on the held-out split: "loss" and the task's (accuracy, rmse or perplexity)
    train_loss: float  # the updates' loss after training, weighted by their samples
    devices: int  # devices that trained a unit this round
    samples: int
    bytes_down: int  # global weights to every device, and each shard the first time a device sees it
    bytes_up: int  # the encoded updates, as uploaded
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # the new global weights
    shard_labels: list[list[int]] = field(default_factory=list)  # classification: per device, samples per class


def job_prepare(data: bytes, filename: str, *, template: str, hparams: dict, seed: int,
                training_scheme: dict | None = None, aggregation: str = "fedavg", target: str | None = None,
                task: str | None = None, tokenizer: str | None = None) -> Job:
    """Read the dataset and make the job as `jobs.services.job_plan` and `job_create` do. DatasetError for a bad
    file (its message says what to fix); SimulationError for a template, hyper-parameter or algorithm the site
    would refuse."""
    try:
        scheme = algorithms.scheme(**(training_scheme or {}))
    except algorithms.InvalidScheme as e:
        raise SimulationError(str(e)) from e
    if aggregation not in robust.RULES:
        raise SimulationError(f"aggregation must be one of {', '.join(robust.RULES)}; got {aggregation!r}.")
    try:
        spec = zoo.get_template(template)
        hp = zoo.validate_hparams(template, hparams)
    except ValueError as e:  # UnknownTemplate, InvalidHParams
        raise SimulationError(str(e)) from e
    if spec.needs_base:
        raise SimulationError(f"The {template} template fine-tunes uploaded base weights; simulate trains "
                              "templates that start from scratch.")
    fmt = datasets.sniff_format(filename, data[:4096])
    parsed = datasets.parse_dataset(data, fmt, target=target, task=task, tokenizer=tokenizer)
    profile = parsed.profile
    if profile.get("kind") == "weights":
        raise SimulationError(f"{filename} holds model weights, not training data.")
    try:
        model_config = zoo.model_config_for(template, profile, hp)
    except (zoo.InvalidHParams, zoo.IncompatibleData) as e:
        raise SimulationError(str(e)) from e
    rows = preparation.sample_count(profile, model_config)
    too_large = preparation.decoded_too_large(profile, model_config, rows)
    if too_large:
        raise SimulationError(too_large)
    if rows < datasets.MIN_ROWS:
        raise SimulationError(f"This dataset gives {rows} training samples for this model; at least "
                              f"{datasets.MIN_ROWS} are needed.")
    options = preparation.parse_options(profile, model_config)
    X, y = preparation.samples(datasets.parse_dataset(data, fmt, target=target, **options), model_config)
    X_train, y_train, X_test, y_test = plan.holdout(X, y, seed=seed)
    state = plan.initial_state(template, model_config, seed=seed, X_train=X_train, y_train=y_train)
    # The site keeps both splits as shard bytes and trains and evaluates on what it reads back.
    X_train, y_train = tensors.bytes_to_shard(tensors.shard_to_bytes(X_train.contiguous(), y_train.contiguous()))
    X_test, y_test = tensors.bytes_to_shard(tensors.shard_to_bytes(X_test.contiguous(), y_test.contiguous()))
    return Job(template, hp, model_config, scheme, aggregation, seed, X_train, y_train, X_test, y_test, state)


def simulate(job: Job, *, rounds: int, devices: int, non_iid: float | None = None) -> Iterator[RoundReport]:
    """Run `rounds` rounds with `devices` devices and report each as it ends. `non_iid` (alpha > 0): every
    device keeps one Dirichlet(alpha) label-skewed share of the training split for the whole job, instead of
    the platform's contiguous shards. Stops early, with SimulationError, when training diverges."""
    if rounds < 1 or devices < 1:
        raise SimulationError(f"rounds and devices must be at least 1 (got {rounds} rounds, {devices} devices).")
    return _rounds(job, rounds, devices, _partition(job, devices, non_iid))


def _rounds(job: Job, rounds: int, devices: int, parts: list[torch.Tensor] | None) -> Iterator[RoundReport]:
    global_state, momentum = job.initial_state, None
    seen: list[set[str]] = [set() for _ in range(devices)]  # shard hashes each device has cached
    for number in range(1, rounds + 1):
        if parts is None:
            shards = plan.round_shards(len(job.y_train), [1.0] * devices, batch_size=job.hparams["batch_size"])
            rows = [(s.device, slice(s.start, s.stop)) for s in shards]
        else:
            rows = list(enumerate(parts))
        weights_bytes = len(tensors.state_dict_to_bytes(global_state))
        states, samples, losses, labels = [], [], [], []
        down = up = 0
        for index, (device, take) in enumerate(rows):
            X, y = job.X_train[take], job.y_train[take]
            shard = tensors.shard_to_bytes(X, y)
            sha = tensors.sha256_hex(shard)
            down += weights_bytes + (0 if sha in seen[device] else len(shard))
            seen[device].add(sha)
            model = zoo.build_model(job.template, job.model_config)
            model.load_state_dict(global_state)
            args = plan.unit_train_args(job.template, job.hparams, seed=plan.unit_seed(job.seed, number, index),
                                        inner_steps=job.scheme.inner_steps)
            result = training.train_local(model, X, y, **args)
            upload = codec.encode_update(result.state_dict, global_state, job.scheme.update_encoding)
            up += len(upload)
            states.append(codec.decode_update(upload, global_state, job.scheme.update_encoding))
            samples.append(result.samples)
            losses.append(result.loss_after)
            if job.task == "classification":
                labels.append(np.bincount(y.numpy(), minlength=job.model_config["num_classes"]).tolist())
        combined = robust.aggregate(plan.round_rule(job.aggregation, len(states)), states, samples, global_state)
        global_state, momentum = algorithms.next_global(job.scheme, global_state, combined, momentum)
        model = zoo.build_model(job.template, job.model_config)
        model.load_state_dict(global_state)
        metrics = training.evaluate(model, job.X_test, job.y_test)
        if not math.isfinite(metrics["loss"]):
            raise SimulationError(f"Training diverges: the loss became infinite or NaN in round {number}. "
                                  f"Lower the learning rate (lr={job.hparams.get('lr')}).")
        yield RoundReport(number, metrics, plan.train_loss(losses, samples), len(states), sum(samples), down, up,
                          global_state, labels)


def _partition(job: Job, devices: int, non_iid: float | None) -> list[torch.Tensor] | None:
    """Each device's rows for a non-IID run (devices left with no rows sit the job out); None: the platform's."""
    if not non_iid:
        return None
    if job.task != "classification":
        raise SimulationError("--non-iid skews each device's labels, so it needs a classification dataset; "
                              f"this job is {job.task.replace('_', ' ')}.")
    if not non_iid > 0 or not math.isfinite(non_iid):
        raise SimulationError(f"--non-iid must be a positive Dirichlet alpha (e.g. 0.5); got {non_iid}.")
    split = dirichlet_split(job.y_train.numpy(), devices, non_iid, np.random.default_rng(job.seed))
    return [torch.from_numpy(part) for part in split if len(part)]
