"""Robust aggregation rules, chosen per job, for rounds where some devices may be malicious.

Pure functions over state dicts, like `aggregation.fedavg`: coordinate-wise trimmed mean, coordinate-wise
median (Yin et al. 2018), and norm clipping before averaging (Sun et al. 2019). Order statistics work on
cache-sized flat chunks of all clients at once, so memory stays ~K chunks, never K copies of the model.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from muninn_worker.federated.aggregation import CHUNK_BYTES, AggregationError, _check_states, fedavg

RULES = ("fedavg", "trimmed_mean", "median", "norm_clip")
State = Mapping[str, torch.Tensor]


def trimmed_mean(states: Sequence[State], *, trim: float = 0.2) -> dict[str, torch.Tensor]:
    """Per coordinate, drop the floor(trim*K) largest and smallest values and average the rest (unweighted:
    a sample count is a claim, and claims are what an attacker controls)."""
    k = math.floor(trim * len(states))
    if not 0 <= trim < 0.5 or 2 * k >= len(states):
        raise AggregationError(f"cannot trim {k} of {len(states)} updates from each side (trim={trim})")
    return _coordinatewise(states, lambda ordered: ordered[k: len(states) - k].mean(dim=0))


def coordinate_median(states: Sequence[State]) -> dict[str, torch.Tensor]:
    """Per coordinate, the median (the mean of the two middle values when K is even)."""
    middle = len(states) // 2
    if len(states) % 2:
        return _coordinatewise(states, lambda ordered: ordered[middle])
    return _coordinatewise(states, lambda ordered: (ordered[middle - 1] + ordered[middle]) / 2)


def update_norms(states: Sequence[State], global_state: State) -> list[float]:
    """L2 norm of each client's change against the global weights, over all floating tensors."""
    norms = []
    for state in states:
        total = 0.0
        for name, ref in global_state.items():
            if ref.is_floating_point():
                total += float((state[name].double() - ref.double()).pow(2).sum())
        norms.append(math.sqrt(total))
    return norms


def norm_clipped_fedavg(states: Sequence[State], weights: Sequence[float], global_state: State, *,
                        max_norm: float | None = None) -> dict[str, torch.Tensor]:
    """FedAvg of updates whose change is scaled down to at most `max_norm` (default: the median change
    norm of this round, so a scaled-up update counts no more than a typical one)."""
    _check_states([global_state, *states])
    norms = update_norms(states, global_state)
    bound = max_norm if max_norm is not None else sorted(norms)[(len(norms) - 1) // 2]
    clipped = []
    for state, norm in zip(states, norms):
        factor = 1.0 if norm <= bound or norm == 0 else bound / norm
        clipped.append({
            name: (ref.float() + (state[name].float() - ref.float()) * factor).to(ref.dtype)
            if ref.is_floating_point() else state[name]
            for name, ref in global_state.items()
        })
    return fedavg(clipped, weights)


def aggregate(rule: str, states: Sequence[State], weights: Sequence[float], global_state: State,
              **options: float) -> dict[str, torch.Tensor]:
    """The job's chosen rule."""
    if rule == "fedavg":
        return fedavg(states, weights)
    if rule == "trimmed_mean":
        return trimmed_mean(states, **options)
    if rule == "median":
        return coordinate_median(states)
    if rule == "norm_clip":
        return norm_clipped_fedavg(states, weights, global_state, **options)
    raise AggregationError(f"unknown aggregation rule {rule!r}; choose one of {', '.join(RULES)}")


def _coordinatewise(states: Sequence[State], reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Apply `reduce` to the sorted-along-clients values of every floating coordinate, chunk by chunk.
    Non-floating tensors (counters) come from the first client."""
    _check_states(states)
    result: dict[str, torch.Tensor] = {}
    for name, first in states[0].items():
        if not first.is_floating_point():
            result[name] = first.clone()
            continue
        flats = [state[name].reshape(-1) for state in states]
        out = torch.empty(first.numel(), dtype=first.dtype)
        chunk = max(1, CHUNK_BYTES // (4 * len(states)))
        for start in range(0, first.numel(), chunk):
            stop = min(start + chunk, first.numel())
            stacked = torch.stack([flat[start:stop].float() for flat in flats])
            out[start:stop] = reduce(stacked.sort(dim=0).values).to(first.dtype)
        result[name] = out.view(first.shape)
    return result
