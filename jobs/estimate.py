"""How much work a job is: FLOPs counted by torch's FLOP counter, converted to hardware units (HU).

Counted the same way for the quote and for each unit's credit, so the two always agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from muninn_worker import flops as worker_flops
from muninn_worker.federated import algorithms

from .hu import flops_to_hu


@dataclass(frozen=True)
class Estimate:
    flops_per_sample: int
    flops_per_round: int
    flops_total: int
    peak_memory_bytes: int
    forward_flops_per_sample: int = 0
    train_samples_per_round: int = 0  # the samples a round's training passes go over (at most, for DiLoCo)
    units_per_round: int = 0  # DiLoCo: the most units a round can have, which the estimate pays for; FedAvg: 0

    @property
    def hu(self) -> Decimal:
        return flops_to_hu(self.flops_total)


def job_estimate(*, template: str, model_config: dict, hparams: dict, n_train: int, rounds: int,
                 inner_steps: int | None = None) -> Estimate:
    """Every round trains every training sample `epochs` times, wherever the shards land, and evaluates each
    shard twice for the receipt (loss before and after): the work a device actually does.

    DiLoCo (`inner_steps`): each unit trains inner_steps × batch samples whatever its shard's size, so a round
    costs that times its number of units; the estimate counts the most units a round can have, which makes
    it a ceiling however many devices turn up (the unused part of the hold is released at the end)."""
    per_sample = worker_flops.flops_per_sample(template, model_config, hparams["batch_size"])
    forward = worker_flops.forward_flops_per_sample(template, model_config, hparams["batch_size"])
    units = 0
    if inner_steps is None:
        trained = worker_flops.train_samples(n_train, hparams["epochs"])
    else:
        units = algorithms.max_units_per_round(n_train, hparams["batch_size"])
        trained = units * worker_flops.train_samples(min(hparams["batch_size"], n_train), hparams["epochs"],
                                                     inner_steps=inner_steps, batch_size=hparams["batch_size"])
    per_round = per_sample * trained + n_train * worker_flops.RECEIPT_PASSES * forward
    memory = worker_flops.peak_memory_bytes(template, model_config, hparams["batch_size"])
    return Estimate(per_sample, per_round, per_round * rounds, memory, forward, trained, units)


def unit_flops(*, flops_per_sample: int, samples: int, epochs: int, forward_flops_per_sample: int = 0,
               inner_steps: int | None = None, batch_size: int | None = None) -> int:
    return worker_flops.unit_flops(flops_per_sample, samples, epochs, forward_flops_per_sample,
                                   inner_steps=inner_steps, batch_size=batch_size)
