"""Aggregation rules: turn a round's verified client updates into the next global weights.

Pure functions over state dicts (parameter name -> tensor): no Django, no I/O, so the round task can call
them on whatever it loaded and the tests can call them on hand-made tensors. Robust rules (trimmed mean,
median, norm clipping) belong here too and can reuse the validation below.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import torch

__all__ = ["AggregationError", "CHUNK_BYTES", "diloco_outer_step", "fedavg"]

# Size of the accumulator slice that stays in cache while every client's matching slice streams through it.
# Measured on a 2-core Xeon (2 MiB L2 per core), 10 x 50M fp32: 1-2 MiB were fastest; 128 KiB and below
# lose torch's intra-op threading (its grain size is 32768 elements), 4 MiB and up was slower again.
CHUNK_BYTES = 1 << 20


class AggregationError(ValueError):
    """The client updates cannot be aggregated: no updates, mismatched models, or bad weights."""


def fedavg(
    states: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[int | float],
) -> dict[str, torch.Tensor]:
    """Average the clients' states, each weighted by its number of training samples (FedAvg).

    Floating (and complex) tensors are averaged, accumulating in at least float32 (float64 stays float64),
    and returned in their input dtype. Other tensors (step counters, integer buffers) cannot be averaged
    meaningfully: they are copied from the client with the largest weight (the first of them on a tie).
    A single client gets its own state back, bit for bit. The result never shares memory with the inputs.

    Raises AggregationError when there are no states, the states differ in keys, shapes or dtypes, or the
    weights are not one positive finite number per state.
    """
    _check_states(states)
    coefficients = _normalised_weights(weights, len(states))
    if len(states) == 1:
        return {name: tensor.clone() for name, tensor in states[0].items()}

    heaviest = states[max(range(len(weights)), key=lambda index: weights[index])]
    result: dict[str, torch.Tensor] = {}
    for name, reference in states[0].items():
        if reference.is_floating_point() or reference.is_complex():
            result[name] = _weighted_sum([state[name] for state in states], coefficients)
        else:
            result[name] = heaviest[name].clone()
    return result


def _check_states(states: Sequence[Mapping[str, torch.Tensor]]) -> None:
    """Every state must hold tensors with the same names, shapes and dtypes as the first one."""
    if len(states) == 0:
        raise AggregationError("Nothing to aggregate: no client states were given.")
    reference = states[0]
    for name, tensor in reference.items():
        if not isinstance(tensor, torch.Tensor):
            raise AggregationError(f"Client 0: {name!r} is a {type(tensor).__name__}, not a tensor.")
    for index, state in enumerate(states[1:], start=1):
        if state.keys() != reference.keys():
            missing = sorted(reference.keys() - state.keys())
            extra = sorted(state.keys() - reference.keys())
            raise AggregationError(
                f"Client {index} does not match client 0's parameters: missing {missing}, extra {extra}."
            )
        for name, expected in reference.items():
            tensor = state[name]
            if not isinstance(tensor, torch.Tensor):
                raise AggregationError(f"Client {index}: {name!r} is a {type(tensor).__name__}, not a tensor.")
            if tensor.shape != expected.shape:
                raise AggregationError(
                    f"Client {index}: {name!r} has shape {tuple(tensor.shape)}, "
                    f"client 0 has {tuple(expected.shape)}."
                )
            if tensor.dtype != expected.dtype:
                raise AggregationError(
                    f"Client {index}: {name!r} has dtype {tensor.dtype}, client 0 has {expected.dtype}."
                )


def _normalised_weights(weights: Sequence[int | float], count: int) -> list[float]:
    """One positive finite weight per state, scaled to sum to one (computed once, in float64)."""
    if len(weights) != count:
        raise AggregationError(f"Got {len(weights)} weights for {count} client states; need one per state.")
    for index, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise AggregationError(f"Weight of client {index} is {weight!r}; it must be a number of samples.")
        try:
            value = float(weight)
        except OverflowError:
            value = math.inf
        if not (math.isfinite(value) and value > 0):
            raise AggregationError(f"Weight of client {index} is {weight!r}; it must be positive and finite.")
    total = math.fsum(float(weight) for weight in weights)
    return [float(weight) / total for weight in weights]


def _weighted_sum(tensors: list[torch.Tensor], coefficients: list[float]) -> torch.Tensor:
    """sum(c * t) over same-shaped tensors, one cache-sized chunk at a time.

    Summing whole tensors would read and write the accumulator once per client (about 3x the memory
    traffic of the inputs); keeping one chunk of it in cache while the K client chunks stream through makes
    the pass cost roughly one read of the inputs plus one write of the result.
    """
    first = tensors[0]
    accumulator_dtype = torch.promote_types(first.dtype, torch.float32)
    result = torch.empty(first.shape, dtype=first.dtype, device=first.device)
    flat_result = result.view(-1)
    flats = [tensor.reshape(-1) for tensor in tensors]  # a view unless the tensor is non-contiguous
    size = flat_result.numel()
    chunk = max(1, CHUNK_BYTES // accumulator_dtype.itemsize)
    # Half-precision inputs accumulate in a reused float32 scratch slice; the others directly in the result.
    scratch = None
    if accumulator_dtype != first.dtype:
        scratch = torch.empty(min(chunk, size), dtype=accumulator_dtype, device=first.device)

    for start in range(0, size, chunk):
        stop = min(start + chunk, size)
        if scratch is None:
            accumulator = flat_result[start:stop]
            torch.mul(flats[0][start:stop], coefficients[0], out=accumulator)
        else:
            # copy first: mul(out=) would round the products to the input's precision before widening.
            accumulator = scratch[: stop - start]
            accumulator.copy_(flats[0][start:stop]).mul_(coefficients[0])
        for flat, coefficient in zip(flats[1:], coefficients[1:]):
            accumulator.add_(flat[start:stop], alpha=coefficient)
        if scratch is not None:
            flat_result[start:stop].copy_(accumulator)
    return result


def diloco_outer_step(
    global_state: Mapping[str, torch.Tensor],
    averaged_state: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor] | None,
    *,
    lr: float = 0.7,
    beta: float = 0.9,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """DiLoCo's outer optimizer (Douillard et al. 2023): the averaged change is a pseudo-gradient
    g = global - average, applied with Nesterov momentum, as torch.optim.SGD(nesterov=True) would:
    m = beta*m + g;  global -= lr * (g + beta*m). Returns (new global state, new momentum buffers).

    Non-floating tensors are taken from the average. With lr=1 and beta=0 this is plain FedAvg."""
    new_state: dict[str, torch.Tensor] = {}
    new_momentum: dict[str, torch.Tensor] = {}
    for name, current in global_state.items():
        average = averaged_state[name]
        if not current.is_floating_point():
            new_state[name] = average.clone()
            continue
        g = current.float() - average.float()
        m = g if momentum is None or name not in momentum else momentum[name].float() * beta + g
        new_momentum[name] = m
        new_state[name] = (current.float() - lr * (g + beta * m)).to(current.dtype)
    return new_state, new_momentum
