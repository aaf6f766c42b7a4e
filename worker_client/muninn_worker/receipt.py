"""The work receipt uploaded with a unit's result (see docs/worker-protocol.md, "result").

It binds the result to its inputs by hash (global weights, shard) and to the uploaded bytes
(`output_sha256`), commits to the checkpoint at every segment boundary (`checkpoints`), and carries the
numbers the site's plausibility checks look at.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone

from muninn_worker.training import TrainResult

__all__ = ["build_receipt", "utc_now_iso"]


def utc_now_iso() -> str:
    """Now in UTC as ISO 8601 with a Z suffix, e.g. 2026-11-21T10:00:00.123Z."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def build_receipt(
    unit: dict,
    result: TrainResult,
    *,
    output_sha256: str,
    started_at: str,
    finished_at: str,
    segment_steps: int,
    checkpoints: list[list[str]],
) -> dict:
    """The receipt for `unit` (the claim's unit object) trained into `result` and uploaded as bytes
    hashing to `output_sha256`. started_at/finished_at bracket local training. `checkpoints` commits to the
    state at every boundary of `segment_steps` steps (muninn_worker.challenge.CheckpointStore.seal)."""
    return {
        "unit": unit["id"],
        "weights_sha256": unit["weights_sha256"],
        "shard_sha256": unit["shard_sha256"],
        "output_sha256": output_sha256,
        "samples": result.samples,
        "steps": result.steps,
        "loss_before": _finite_or_none(result.loss_before),
        "loss_after": _finite_or_none(result.loss_after),
        "started_at": started_at,
        "finished_at": finished_at,
        "train_seconds": round(result.train_seconds, 6),
        "segment_steps": segment_steps,
        "checkpoints": checkpoints,
    }


def _finite_or_none(value: float) -> float | None:
    # JSON has no NaN/Infinity; a diverged run reports null and the site's checks decide what that means.
    return float(value) if math.isfinite(value) else None
