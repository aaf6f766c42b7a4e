"""What a job's rounds are made of, as the site plans them: the held-out split and initial weights a job starts
from, the shards of a round, each unit's seed and training arguments, and the rule that combines a round.

`jobs.services` calls these when it creates a job, opens a round and aggregates one; `muninn_worker.simulation`
calls the same ones in one process, so a simulated job takes exactly the platform's steps.
"""
from __future__ import annotations

from torch import Tensor

from muninn_worker import datasets, zoo
from muninn_worker.federated.sharding import Shard, plan_shards

__all__ = ["holdout", "initial_state", "round_shards", "unit_seed", "unit_train_args", "round_rule", "train_loss"]


def holdout(X: Tensor, y: Tensor, *, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(X_train, y_train, X_test, y_test): the job's held-out split, made once with the job's seed, its training
    rows shuffled with the seed (datasets.training_order): every shard of a round a sample of the whole."""
    train_idx, test_idx = datasets.split_holdout(len(y), seed=seed)
    train_idx = train_idx[datasets.training_order(len(train_idx), seed=seed)]
    return X[train_idx], y[train_idx], X[test_idx], y[test_idx]


def initial_state(template: str, model_config: dict, *, seed: int, X_train: Tensor, y_train: Tensor) -> dict:
    """The job's first global weights: the template's seeded initialisation, with its data-derived buffers
    (feature scaling, a regression target's scale) filled from the training split."""
    return zoo.get_template(template).fit_state(zoo.init_state(template, model_config, seed), X_train, y_train)


def round_shards(n_train: int, throughputs: list[float], *, batch_size: int) -> list[Shard]:
    """A round's shards of the training split for devices of these throughputs: never smaller than a batch
    (or the whole split, when that is smaller)."""
    return plan_shards(n_train, throughputs, min_shard=min(batch_size, n_train))


def unit_seed(job_seed: int, round_number: int, index: int) -> int:
    """The seed of unit `index` (its position in the round's plan) of round `round_number` (from 1)."""
    return (job_seed * 1_000_003 + round_number * 10_007 + index) % 2**31


def unit_train_args(template: str, hparams: dict, *, seed: int, inner_steps: int | None) -> dict:
    """The arguments of `training.train_local` for a unit (DiLoCo: `inner_steps` steps instead of epochs)."""
    return {"epochs": hparams["epochs"], "batch_size": hparams["batch_size"], "lr": hparams["lr"],
            "momentum": hparams.get("momentum", 0.0), "seed": seed,
            "optimizer": zoo.get_template(template).optimizer, "inner_steps": inner_steps}


def round_rule(rule: str, updates: int) -> str:
    """The job's aggregation rule for a round of `updates` updates: a trimmed mean needs five to trim one from
    each side, so with fewer it falls back to the median (three or four) or FedAvg."""
    if rule == "trimmed_mean" and updates < 5:
        return "median" if updates >= 3 else "fedavg"
    return rule


def train_loss(losses: list[float], samples: list[int]) -> float:
    """The round's training loss: each update's loss after training, weighted by its samples."""
    return sum(loss * n for loss, n in zip(losses, samples)) / sum(samples)

