"""A job's training algorithm: plain FedAvg, or DiLoCo (an outer Nesterov step over the averaged change), and
how its devices upload their updates. Pure: validation of the customer's choice and the server's round update
over plain values and tensors, no Django.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from muninn_worker.federated.aggregation import diloco_outer_step

ALGORITHMS = ("fedavg", "diloco")
ENCODINGS = ("fp32", "fp16", "int8")  # muninn_worker.codec.ENCODINGS; the site decodes what the client encodes
# DiLoCo's defaults (Douillard et al. 2023: outer lr 0.7, Nesterov momentum 0.9); inner steps sized for the
# small shards of a marketplace round rather than the paper's H=500 on a language model.
DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9
DEFAULT_INNER_STEPS = 20
MAX_INNER_STEPS = 10_000
MAX_OUTER_LR = 10.0
DEFAULT_ENCODING = "fp32"


class InvalidScheme(ValueError):
    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Scheme:
    """What the job trains with; the fields are the Job's (and the Quote's) of the same names."""

    algorithm: str = "fedavg"
    outer_lr: float | None = None
    outer_momentum: float | None = None
    inner_steps: int | None = None
    update_encoding: str = DEFAULT_ENCODING

    @property
    def is_diloco(self) -> bool:
        return self.algorithm == "diloco"

    def fields(self) -> dict:
        return asdict(self)


def scheme(*, algorithm: str | None = None, outer_lr: float | None = None, outer_momentum: float | None = None,
           inner_steps: int | None = None, update_encoding: str | None = None) -> Scheme:
    """The customer's choice, checked and completed with the defaults. DiLoCo's settings are refused on a
    FedAvg job (it trains `epochs` and averages), so nobody pays for a setting that does nothing."""
    algorithm = algorithm or "fedavg"
    if algorithm not in ALGORITHMS:
        raise InvalidScheme(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}.", "algorithm")
    encoding = update_encoding or DEFAULT_ENCODING
    if encoding not in ENCODINGS:
        raise InvalidScheme(f"update_encoding must be one of {', '.join(ENCODINGS)}; got {encoding!r}.",
                            "update_encoding")
    given = {k: v for k, v in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum),
                               ("inner_steps", inner_steps)) if v is not None}
    if algorithm == "fedavg":
        if given:
            field = next(iter(given))
            raise InvalidScheme(f"{field} is a DiLoCo setting; a fedavg job trains `epochs` per round and averages. "
                                f"Set \"algorithm\": \"diloco\" or leave {field} out.", field)
        return Scheme("fedavg", update_encoding=encoding)
    lr = DEFAULT_OUTER_LR if outer_lr is None else _number(outer_lr, "outer_lr")
    if not 0 < lr <= MAX_OUTER_LR:
        raise InvalidScheme(f"outer_lr must be above 0 and at most {MAX_OUTER_LR:g}; got {lr:g}.", "outer_lr")
    beta = DEFAULT_OUTER_MOMENTUM if outer_momentum is None else _number(outer_momentum, "outer_momentum")
    if not 0 <= beta < 1:
        raise InvalidScheme(f"outer_momentum must be at least 0 and below 1; got {beta:g}.", "outer_momentum")
    steps = DEFAULT_INNER_STEPS if inner_steps is None else inner_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_INNER_STEPS:
        raise InvalidScheme(f"inner_steps must be a whole number from 1 to {MAX_INNER_STEPS}; got {steps!r}.",
                            "inner_steps")
    return Scheme("diloco", lr, beta, steps, encoding)


def _number(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidScheme(f"{field} must be a finite number; got {value!r}.", field)
    return float(value)


def max_units_per_round(n_train: int, batch_size: int) -> int:
    """The most units a round can have: the shard planner never makes a shard smaller than a batch (or the
    whole training set, when that is smaller), so a DiLoCo quote, which pays inner_steps × batch per unit,
    is a ceiling for any number of devices online."""
    return max(1, n_train // max(1, min(batch_size, n_train)))


def next_global(scheme_: Scheme, global_state: Mapping[str, torch.Tensor], combined: Mapping[str, torch.Tensor],
                momentum: Mapping[str, torch.Tensor] | None) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The next global weights from the round's combined update (the job's aggregation rule over the decoded
    states): FedAvg takes it as it is; DiLoCo treats global - combined as a pseudo-gradient and takes an outer
    Nesterov step with the job's momentum buffers. Returns (weights, new momentum buffers or None)."""
    if not scheme_.is_diloco:
        return dict(combined), None
    return diloco_outer_step(global_state, combined, momentum, lr=scheme_.outer_lr, beta=scheme_.outer_momentum)
