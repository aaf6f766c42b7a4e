"""Segments and their checkpoints: how a unit's training is committed to, and later checked in pieces.

A unit's T optimizer steps are cut into segments of k steps (k comes with the unit; the last segment may be
shorter). The state at each boundary, the model's weights and the optimizer's state (momentum buffers, Adam's
moments), is a checkpoint. The receipt commits to every boundary as two sha256 hashes, one of the weights and
one of the optimizer state, each over `tensors.state_dict_to_bytes` of that part:

    boundary 0      the round's global weights and a fresh optimizer (zeros)
    boundary i      after min(i * k, T) steps
    boundary last   the uploaded result as the site decodes it (`codec.roundtrip`), and the optimizer then

When the site challenges segment j, the device uploads the checkpoints at boundaries j and j + 1
(`checkpoint_to_bytes`); a validator re-trains those k steps from the first and compares with the second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from muninn_worker.tensors import bytes_to_state_dict, sha256_hex, state_dict_to_bytes

__all__ = ["Checkpoint", "boundaries", "segment_count", "commitment", "checkpoint_to_bytes", "bytes_to_checkpoint",
           "BadCheckpoint", "MAX_SEGMENTS"]

MAX_SEGMENTS = 4096  # a receipt commits to at most this many segments (the site sizes k to fit)
_WEIGHTS, _OPTIMIZER = "weights/", "optimizer/"


class BadCheckpoint(ValueError):
    """Bytes that are not a checkpoint file (safetensors of weights/… and optimizer/… tensors)."""


@dataclass(frozen=True)
class Checkpoint:
    weights: dict[str, Tensor]
    optimizer: dict[str, Tensor]

    def commitment(self) -> list[str]:
        return commitment(self.weights, self.optimizer)


def segment_count(total_steps: int, k: int) -> int:
    return max(1, math.ceil(total_steps / k))


def boundaries(total_steps: int, k: int) -> list[int]:
    """The step counts at which checkpoints are kept: 0, k, 2k, ..., total_steps."""
    if k < 1:
        raise ValueError(f"segment length must be at least 1 step (got {k})")
    return [min(i * k, total_steps) for i in range(segment_count(total_steps, k) + 1)]


def commitment(weights: dict[str, Tensor], optimizer: dict[str, Tensor]) -> list[str]:
    """[sha256 of the weights' bytes, sha256 of the optimizer state's bytes]."""
    return [sha256_hex(state_dict_to_bytes(weights)), sha256_hex(state_dict_to_bytes(optimizer))]


def checkpoint_to_bytes(checkpoint: Checkpoint) -> bytes:
    """One safetensors file: the weights under `weights/<name>`, the optimizer state under `optimizer/<name>`."""
    merged = {f"{_WEIGHTS}{k}": v for k, v in checkpoint.weights.items()}
    merged.update({f"{_OPTIMIZER}{k}": v for k, v in checkpoint.optimizer.items()})
    return state_dict_to_bytes(merged)


def bytes_to_checkpoint(data: bytes) -> Checkpoint:
    """Parse a checkpoint file (never code: safetensors). BadCheckpoint for anything else."""
    try:
        merged = bytes_to_state_dict(data)
    except ValueError as exc:
        raise BadCheckpoint(str(exc)) from None
    weights = {k[len(_WEIGHTS):]: v for k, v in merged.items() if k.startswith(_WEIGHTS)}
    optimizer = {k[len(_OPTIMIZER):]: v for k, v in merged.items() if k.startswith(_OPTIMIZER)}
    if len(weights) + len(optimizer) != len(merged):
        raise BadCheckpoint("a checkpoint holds only weights/<name> and optimizer/<name> tensors")
    return Checkpoint(weights, optimizer)
