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

    @property
    def hu(self) -> Decimal:
        return flops_to_hu(self.flops_total)


def job_estimate(*, template: str, model_config: dict, hparams: dict, n_train: int, rounds: int) -> Estimate:
    """Every round trains every training sample `epochs` times, wherever the shards land."""
    per_sample = worker_flops.flops_per_sample(template, model_config, hparams["batch_size"])
    per_round = worker_flops.unit_flops(per_sample, n_train, hparams["epochs"])
    memory = worker_flops.peak_memory_bytes(template, model_config, hparams["batch_size"])
    return Estimate(per_sample, per_round, per_round * rounds, memory)


def unit_flops(*, flops_per_sample: int, samples: int, epochs: int) -> int:
    return worker_flops.unit_flops(flops_per_sample, samples, epochs)
