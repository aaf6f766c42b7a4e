"""How much work a job is: FLOPs counted by torch's FLOP counter, converted to hardware units (HU).

Counted the same way for the quote and for each unit's credit, so the two always agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from muninn_worker import flops as worker_flops

from .hu import flops_to_hu


@dataclass(frozen=True)
class Estimate:
    flops_per_sample: int
    flops_per_round: int
    flops_total: int
    peak_memory_bytes: int
    forward_flops_per_sample: int = 0

    @property
    def hu(self) -> Decimal:
        return flops_to_hu(self.flops_total)


def job_estimate(*, template: str, model_config: dict, hparams: dict, n_train: int, rounds: int) -> Estimate:
    """Every round trains every training sample `epochs` times, wherever the shards land, and evaluates each
    shard twice for the receipt (loss before and after): the work a device actually does."""
    per_sample = worker_flops.flops_per_sample(template, model_config, hparams["batch_size"])
    forward = worker_flops.forward_flops_per_sample(template, model_config, hparams["batch_size"])
    per_round = worker_flops.unit_flops(per_sample, n_train, hparams["epochs"], forward)
    memory = worker_flops.peak_memory_bytes(template, model_config, hparams["batch_size"])
    return Estimate(per_sample, per_round, per_round * rounds, memory, forward)


def unit_flops(*, flops_per_sample: int, samples: int, epochs: int, forward_flops_per_sample: int = 0) -> int:
    return worker_flops.unit_flops(flops_per_sample, samples, epochs, forward_flops_per_sample)
