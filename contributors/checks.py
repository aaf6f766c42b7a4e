"""Cheap checks on every uploaded result, before it is accepted: pure functions over plain values and tensors.

Each failure is a `ResultRejected` with a code and a sentence the contributor can act on.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import base64
import math
import binascii

import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from muninn_worker import codec


class ResultRejected(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Expected:
    unit_id: int
    weights_sha256: str
    shard_sha256: str
    samples: int
    steps: int | None = None  # the optimizer steps the site counts for the unit (jobs.services.unit_steps)


def load_public_key(encoded: str) -> Ed25519PublicKey:
    """A device's registered key: base64 of 32 raw Ed25519 bytes. ValueError when it is not one."""
    try:
        raw = base64.b64decode(encoded, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (binascii.Error, ValueError) as exc:
        raise ValueError("public_key must be base64 of a 32-byte Ed25519 public key") from exc


def check_signature(public_key: str, message: bytes, signature: str) -> None:
    """The receipt bytes were signed by the device's private key."""
    if not signature:
        raise ResultRejected("no_signature", "The receipt is not signed: send its Ed25519 signature as 'signature'.")
    try:
        load_public_key(public_key).verify(base64.b64decode(signature, validate=True), message)
    except (binascii.Error, ValueError, InvalidSignature):
        raise ResultRejected("bad_signature", "The receipt's signature does not verify with this device's key.") from None


def check_receipt(receipt: Mapping, *, expected: Expected, output_sha256: str) -> None:
    """The receipt must name this unit, the inputs the site served, and the bytes actually uploaded."""
    if receipt["unit"] != expected.unit_id:
        raise ResultRejected("receipt_unit_mismatch",
                             f"The receipt is for unit {receipt['unit']}, but it was posted to unit {expected.unit_id}.")
    if receipt["weights_sha256"] != expected.weights_sha256:
        raise ResultRejected("receipt_input_mismatch", "The receipt's weights_sha256 is not the round's global weights.")
    if receipt["shard_sha256"] != expected.shard_sha256:
        raise ResultRejected("receipt_input_mismatch", "The receipt's shard_sha256 is not this unit's shard.")
    if receipt["output_sha256"] != output_sha256:
        raise ResultRejected("receipt_output_mismatch",
                             "The receipt's output_sha256 does not match the sha256 of the uploaded weights.")
    if receipt["samples"] != expected.samples:
        raise ResultRejected("receipt_samples_mismatch",
                             f"The receipt claims {receipt['samples']} samples; the unit's shard has {expected.samples}.")
    if expected.steps is not None and receipt["steps"] != expected.steps:
        raise ResultRejected("receipt_steps_mismatch",
                             f"The receipt claims {receipt['steps']} steps; this unit's training takes {expected.steps}.")
    if receipt["finished_at"] < receipt["started_at"]:
        raise ResultRejected("receipt_bad_times", "The receipt finishes before it starts.")


def max_update_bytes(weights_bytes: int) -> int:
    """The most an update of weights this size may take, uploaded or inflated: twice the weights (a float32
    delta with its header is about their size) plus slack for small models."""
    return 2 * weights_bytes + 1_000_000


def max_checkpoint_bytes(weights_bytes: int) -> int:
    """The most a checkpoint of weights this size may take: the weights and up to two optimizer buffers of their
    size (Adam's), plus slack for small models."""
    return 3 * weights_bytes + 1_000_000


def decode_update(data: bytes, reference: Mapping[str, torch.Tensor], encoding: str, *,
                  max_inflated_bytes: int) -> dict[str, torch.Tensor]:
    """The full state an uploaded update stands for (the global weights plus its delta), or the reason it is
    not an update of these weights in this job's encoding."""
    try:
        return codec.decode_update(data, reference, encoding, max_inflated_bytes=max_inflated_bytes)
    except codec.BadUpdate as e:
        raise ResultRejected(e.code, f"The upload is not a {encoding} update of this round's weights: "
                                     f"{e.message}. Send muninn_worker.codec.encode_update(trained, global, "
                                     f"{encoding!r}).") from None


def check_state(result: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> None:
    """Same tensors as the global weights (names, shapes, dtypes), and every value finite."""
    missing = sorted(set(reference) - set(result))
    extra = sorted(set(result) - set(reference))
    if missing or extra:
        raise ResultRejected("wrong_tensors", f"Tensor names differ from the global weights: missing {missing[:5]}, "
                                              f"unexpected {extra[:5]}.")
    for name, ref in reference.items():
        got = result[name]
        if got.shape != ref.shape:
            raise ResultRejected("wrong_shape", f"Tensor '{name}' has shape {list(got.shape)}; expected {list(ref.shape)}.")
        if got.dtype != ref.dtype:
            raise ResultRejected("wrong_dtype", f"Tensor '{name}' has dtype {got.dtype}; expected {ref.dtype}.")
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise ResultRejected("not_finite", f"Tensor '{name}' contains NaN or Inf values.")


# --- Checks against history and the server's own computation ---------------------------------------

LOSS_SLACK_RELATIVE = 0.05
LOSS_SLACK_ABSOLUTE = 0.01
NORM_BOUND_FACTOR = 10.0  # an update may be this many times the job's median update norm
SPEED_FACTOR = 50.0  # a device may be this many times faster than its own measured speed
CLOCK_SLACK_S = 5.0


def finite_or_none(value: float | None) -> float | None:
    """A figure the site computed, as a receipt's evidence can keep it: PostgreSQL's jsonb has no NaN or infinity,
    so writing one failed (finite weights of 1e30 give an infinite loss: a 500 for the upload; a checkpoint that
    is not the model's gives an infinite distance: a check that crashed and was tried again for ever). None is
    "not a number"; the verdict was made on the figure itself."""
    return value if value is None or math.isfinite(value) else None


def update_norm(result: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of the change against the global weights, over every floating tensor."""
    total = sum(float((result[k].double() - v.double()).pow(2).sum()) for k, v in reference.items()
                if v.is_floating_point())
    return total ** 0.5


def norm_bound(previous_norms: list[float]) -> float | None:
    """NORM_BOUND_FACTOR × the median of the job's earlier accepted update norms (per optimizer step);
    None until there are 3."""
    if len(previous_norms) < 3:
        return None
    ordered = sorted(previous_norms)
    return NORM_BOUND_FACTOR * ordered[len(ordered) // 2]


def check_update_norm(norm: float, bound: float | None, *, per_step: float | None = None) -> None:
    """`bound` applies to `per_step` (the norm over the unit's optimizer steps) when given, else to `norm`."""
    if norm == 0:
        raise ResultRejected("no_training", "The weights are the global weights unchanged: no training was done.")
    measured = norm if per_step is None else per_step
    if bound is not None and measured > bound:
        raise ResultRejected("update_too_large", f"The update's norm per step {measured:.4g} is far above this "
                                                 f"job's updates (bound {bound:.4g}).")


def check_shard_loss(before: float, after: float) -> None:
    """On a few samples of the unit's own shard, the trained weights must not be worse than the global ones."""
    if not after <= before + max(LOSS_SLACK_RELATIVE * before, LOSS_SLACK_ABSOLUTE):
        raise ResultRejected("loss_not_improved", f"On samples of its own shard the result's loss is {after:.4g}, "
                                                  f"worse than the global weights' {before:.4g}.")


def check_timing(*, train_seconds: float, held_seconds: float) -> None:
    """The training time claimed must fit inside the lease the site saw (the device measures the duration on
    its own monotonic clock after claiming, so an honest one always fits)."""
    if train_seconds > held_seconds + CLOCK_SLACK_S:
        raise ResultRejected("implausible_time", f"The receipt claims {train_seconds:.1f} s of training, but the "
                                                 f"unit was leased only {held_seconds:.1f} s ago.")


def implausibly_fast(*, train_seconds: float, work_samples: int, device_speed: float) -> bool:
    """Far faster than the device has been. Not a refusal on its own: a shared machine's speed swings by two
    orders of magnitude with its load, so such a result is re-executed instead (and pay never depends on
    time: HU count FLOPs)."""
    return device_speed > 0 and train_seconds > 0 and work_samples / train_seconds > SPEED_FACTOR * device_speed


def reexecution_distance(submitted: Mapping[str, torch.Tensor], recomputed: Mapping[str, torch.Tensor],
                         reference: Mapping[str, torch.Tensor]) -> float:
    """‖submitted − recomputed‖ / ‖recomputed − global‖ over floating tensors: 0 for the same computation;
    honest runs on other CPUs and thread counts stay around 1e-7 (bench/cheating.py measures it)."""
    diff = sum(float((submitted[k].double() - recomputed[k].double()).pow(2).sum())
               for k, v in reference.items() if v.is_floating_point()) ** 0.5
    scale = update_norm(recomputed, reference)
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def check_reexecution(distance: float, tolerance: float) -> None:
    if not distance <= tolerance:
        raise ResultRejected("reexecution_mismatch", f"Re-executing the unit gave different weights "
                                                     f"(relative distance {distance:.3g} > {tolerance:g}).")


# --- Segment checks: the committed chain of checkpoints, and one segment re-trained ------------------

def check_chain(receipt: Mapping, *, segment_steps: int, segments: int, first: list[str], last_weights: str) -> None:
    """The receipt commits to one checkpoint per boundary, starting at the round's global weights with a fresh
    optimizer (`first`) and ending at the uploaded result as decoded (`last_weights`)."""
    chain = receipt["checkpoints"]
    if receipt["segment_steps"] != segment_steps:
        raise ResultRejected("chain_mismatch", f"The receipt's segment_steps is {receipt['segment_steps']}; this "
                                               f"unit's segments are {segment_steps} steps.")
    if len(chain) != segments + 1:
        raise ResultRejected("chain_mismatch", f"The receipt commits to {len(chain)} checkpoints; this unit's "
                                               f"{segments} segment(s) have {segments + 1} boundaries.")
    if list(chain[0]) != list(first):
        raise ResultRejected("chain_mismatch", "The receipt's first checkpoint is not the round's global weights "
                                               "with a fresh optimizer.")
    if chain[-1][0] != last_weights:
        raise ResultRejected("chain_mismatch", "The receipt's last checkpoint is not the uploaded result.")


# An honest device's other rounding can put one sample's pre-activation on the other side of a ReLU (or break a
# max-pool tie) that the validator's does not: that sample's gradient then moves one output unit's row (and its
# bias) by 1e-4 to 1e-2 of the segment's update, while every other row agrees to ~1e-7 (bench/verification.py
# found it in ~1 of 300 mlp units at k = 32). Every cheat moves all rows. So the distance spares the SPARE_ROWS
# rows that lie farthest apart (two flips: a weight row and a bias entry each) and measures the rest, as long as
# the spared rows stay within SPARE_CAP of the scale (far above every tolerance; more is a failed check).
SPARE_ROWS = 4
SPARE_CAP = 0.05


def _row_sq_diffs(device: Mapping[str, torch.Tensor], validator: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The squared distance of every row (a slice along the first dimension; a 1-d tensor's entries) of every
    floating tensor, in one float64 vector."""
    rows = []
    for k, v in validator.items():
        if not v.is_floating_point():
            continue
        diff = device[k].double() - v.double()
        rows.append(diff.reshape(diff.shape[0], -1).pow(2).sum(dim=1) if diff.dim() else diff.pow(2).reshape(1))
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.float64)


def state_distance(device: Mapping[str, torch.Tensor], validator: Mapping[str, torch.Tensor],
                   scale: float) -> float:
    """‖device − validator‖ over floating tensors, relative to `scale`, leaving out the SPARE_ROWS rows farthest
    apart while together they stay within SPARE_CAP × scale (else the whole distance, spared rows included)."""
    rows = _row_sq_diffs(device, validator)
    total = float(rows.sum())
    if not math.isfinite(total):
        return float("inf")
    if scale <= 0:
        return 0.0 if total == 0 else float("inf")
    spared = float(rows.topk(min(SPARE_ROWS, len(rows))).values.sum()) if len(rows) else 0.0
    if spared ** 0.5 > SPARE_CAP * scale:
        return total ** 0.5 / scale
    return max(total - spared, 0.0) ** 0.5 / scale


def segment_distance(*, device_weights: Mapping[str, torch.Tensor], device_optimizer: Mapping[str, torch.Tensor],
                     validator_weights: Mapping[str, torch.Tensor], validator_optimizer: Mapping[str, torch.Tensor],
                     start_weights: Mapping[str, torch.Tensor]) -> float:
    """How far a device's end of segment lies from the validator's re-training of it: the larger of the
    weights' distance relative to the segment's own update (‖w_dev − w_val‖ / ‖w_val − w_start‖) and the
    optimizer state's relative to its size (‖o_dev − o_val‖ / ‖o_val‖; step counters must match exactly), each
    sparing a few rows (`state_distance`)."""
    if set(device_weights) != set(validator_weights) or set(device_optimizer) != set(validator_optimizer):
        return float("inf")
    steps = [k for k in validator_optimizer if k.startswith("step:")]
    if any(not torch.equal(device_optimizer[k], validator_optimizer[k]) for k in steps):
        return float("inf")
    moments = {k: v for k, v in validator_optimizer.items() if not k.startswith("step:")}
    weights = state_distance(device_weights, validator_weights, update_norm(validator_weights, start_weights))
    size = sum(float(v.double().pow(2).sum()) for v in moments.values()) ** 0.5
    optimizer = state_distance(device_optimizer, moments, size) if moments else 0.0
    return max(weights, optimizer)


# The most a segment's own sensitivity may widen its tolerance to: the calibration keeps every template's tolerance
# below it, and every compute-saving cheat it measured lands ≥ 1.1e-1 away (README "Tolerances").
SENSITIVE_CEILING = 1e-2
SENSITIVE_MULTIPLE = 10  # as the tolerances' own multiple of the worst honest drift


def sensitive_tolerance(tolerance: float, spread: float) -> float:
    """The tolerance of a segment whose honest re-trainings under different arithmetic lie `spread` apart: as
    many times their spread as the calibrated tolerance is times the worst drift it saw, between the tolerance
    and SENSITIVE_CEILING."""
    if not math.isfinite(spread):
        return tolerance
    return max(tolerance, min(SENSITIVE_CEILING, SENSITIVE_MULTIPLE * spread))


def checkpoint_distance(device, validator, start) -> float:
    """`segment_distance` of two ends of a segment and its start, each a checkpoint (`muninn_worker.segments.
    Checkpoint`: its weights and optimizer state): the device's end against the validator's."""
    return segment_distance(device_weights=device.weights, device_optimizer=device.optimizer,
                            validator_weights=validator.weights, validator_optimizer=validator.optimizer,
                            start_weights=start.weights)


def check_segment(distance: float, tolerance: float, *, segment: int) -> None:
    if not distance <= tolerance:
        raise ResultRejected("reexecution_mismatch", f"Re-training segment {segment} from the device's own "
                                                     f"checkpoint gave different weights (relative distance "
                                                     f"{distance:.3g} > {tolerance:.3g}).")
