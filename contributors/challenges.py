"""Challenges: after a result is stored, the site asks for the checkpoints at both ends of the segments it drew.

The receipt already commits to every checkpoint by hash, so the device cannot choose what to answer: an upload
that does not hash to its commitment is a confirmed failure, and so is silence past the deadline. When every
requested checkpoint is in, the unit goes to a validator (contributors.verification).
"""
from __future__ import annotations

import logging
from datetime import datetime

from django.db import transaction
from django.utils import timezone
from muninn_worker import codec, segments, tensors

from jobs import services as jobs
from jobs import storage
from jobs.models import WorkUnit
from muninn.errors import InvalidInput, NotFound

from . import checks, services
from .models import Device, Receipt
from .signals import reexecution_due

log = logging.getLogger(__name__)


def needed_boundaries(receipt: Receipt) -> list[int]:
    """The checkpoints the device must upload: both ends of every challenged segment, except boundary 0 (the
    round's global weights and a fresh optimizer, which the site has)."""
    return sorted({b for j in receipt.challenge_segments for b in (j, j + 1)} - {0})


def missing_boundaries(receipt: Receipt) -> list[int]:
    return [b for b in needed_boundaries(receipt) if str(b) not in receipt.checkpoint_blobs]


def challenge_payload(receipt: Receipt) -> dict | None:
    """What a device is asked for (in the result's answer and in GET /api/worker/challenges)."""
    if receipt.status != Receipt.Status.PENDING or not receipt.challenge_segments:
        return None
    left = (receipt.challenge_deadline - timezone.now()).total_seconds() if receipt.challenge_deadline else 0
    return {"unit": receipt.unit_id, "segments": receipt.challenge_segments,
            "checkpoints": needed_boundaries(receipt), "missing": missing_boundaries(receipt),
            "deadline": receipt.challenge_deadline.isoformat().replace("+00:00", "Z") if receipt.challenge_deadline
            else None, "seconds": max(0, int(left))}


def challenges_open(*, device: Device) -> list[dict]:
    receipts = Receipt.objects.filter(device=device, status=Receipt.Status.PENDING).exclude(challenge_segments=[])
    return [p for p in (challenge_payload(r) for r in receipts.order_by("id")) if p and p["missing"]]


def checkpoint_submit(*, device: Device, unit_id: int, boundary: int, data: bytes,
                      receipt: Receipt | None = None) -> Receipt:
    """Store one challenged checkpoint after checking it against the receipt's commitment. A checkpoint that
    differs from what was committed fails the check at once; a file that is not a checkpoint is a 400 the
    device may correct before the deadline. Uploading a checkpoint already received is a no-op. `receipt`: the
    device's pending receipt for the unit, with its unit, round and job, when the caller has it (a result that
    brought its last checkpoint along: contributors.results)."""
    if receipt is None:
        receipt = (Receipt.objects.select_related("unit__round__job")
                   .filter(unit_id=unit_id, device=device, status=Receipt.Status.PENDING).first())
    if receipt is None:
        raise NotFound(f"Unit {unit_id} has no challenge open for this device (settled, expired, or not yours).",
                       code="no_challenge")
    if boundary not in needed_boundaries(receipt):
        raise InvalidInput(f"Checkpoint {boundary} was not asked for; the challenge needs "
                           f"{needed_boundaries(receipt)}.", code="not_challenged")
    if str(boundary) in receipt.checkpoint_blobs:
        return receipt
    reference = tensors.bytes_to_state_dict(storage.blob_get(receipt.unit.round.weights_sha256))
    sha, mismatch = checkpoint_checked(receipt, boundary, data, reference=reference)
    if mismatch:
        return fail(receipt_id=receipt.pk, code="checkpoint_mismatch", message=mismatch)
    with transaction.atomic():
        locked = Receipt.objects.select_for_update().get(pk=receipt.pk)
        if locked.status != Receipt.Status.PENDING:
            return locked
        locked.checkpoint_blobs = {**locked.checkpoint_blobs, str(boundary): sha}
        locked.save(update_fields=["checkpoint_blobs"])
        if not missing_boundaries(locked):  # every checkpoint is in: the validator checks the segments now
            reexecution_due.send(sender=Receipt, unit_id=unit_id)
    return locked


def checkpoint_checked(receipt: Receipt, boundary: int, data: bytes, *, reference: dict) -> tuple[str, str]:
    """Check checkpoint `boundary` against the receipt's commitment (`reference`: the round's global weights,
    decoded). (its blob's sha256, stored, and ''), or ('', why it is not the committed one: a failed check). A
    file that is not a checkpoint raises InvalidInput: the device may still upload the right one. `receipt` may be
    unsaved (contributors.results checks a checkpoint that came with the result before storing either)."""
    try:
        checkpoint = segments.bytes_to_checkpoint(data)
    except segments.BadCheckpoint as e:
        raise InvalidInput(f"Not a checkpoint file: {e}. Send muninn_worker.segments.checkpoint_to_bytes(...).",
                           code="bad_checkpoint") from None
    try:  # committed garbage is a lie too (values may be non-finite: the re-training judges those)
        checks.check_state(checkpoint.weights, reference)
        mismatch = ""
    except checks.ResultRejected as e:
        mismatch = "" if e.code == "not_finite" else f"{e.code}: {e.message}"
    mismatch = mismatch or _commitment_mismatch(receipt, boundary, checkpoint, reference)
    if mismatch:
        return "", f"Checkpoint {boundary} is not the one the receipt committed to ({mismatch})."
    return storage.blob_put(segments.checkpoint_to_bytes(checkpoint)), ""


def _commitment_mismatch(receipt: Receipt, boundary: int, checkpoint: segments.Checkpoint,
                         reference: dict) -> str:
    """Why the checkpoint is not what the receipt committed to at `boundary` ('' when it is). The last
    boundary carries the trained weights before encoding; they must encode to exactly the uploaded result."""
    committed = receipt.checkpoints[boundary]
    weights_sha, optimizer_sha = segments.commitment(checkpoint.weights, checkpoint.optimizer)
    if boundary == len(receipt.checkpoints) - 1:
        decoded = codec.roundtrip(checkpoint.weights, reference, receipt.unit.round.job.update_encoding)
        weights_sha = segments.commitment(decoded, {})[0]
    if weights_sha != committed[0]:
        return "its weights hash differently"
    if optimizer_sha != committed[1]:
        return "its optimizer state hashes differently"
    return ""


def fail(*, receipt_id: int, code: str, message: str) -> Receipt:
    """The check failed on the device's side (a checkpoint that is not what it committed to, or no answer in
    time): the result is refused, the unit goes back to the queue after its backoff, and the failure is
    confirmed on this unit."""
    with transaction.atomic():
        receipt = Receipt.objects.select_for_update().select_related("device").get(pk=receipt_id)
        if receipt.status != Receipt.Status.PENDING:
            return receipt
        receipt.status, receipt.reason = Receipt.Status.REJECTED, f"{code}: {message}"[:500]
        receipt.verification = {**receipt.verification, "segment_check": {
            **receipt.verification.get("segment_check", {}), "passed": False, "code": code,
            "at": timezone.now().isoformat()}}
        receipt.save(update_fields=["status", "reason", "verification"])
        unit = WorkUnit.objects.select_for_update().get(pk=receipt.unit_id)
        if unit.status == WorkUnit.Status.VERIFYING:
            jobs.unit_reject(unit_id=unit.pk)
        services.device_record_failure(device=receipt.device, reason=receipt.reason, unit_id=receipt.unit_id)
    log.warning("unit %s from device %s: %s", receipt.unit_id, receipt.device_id, message)
    return receipt


def challenges_expire(*, now: datetime | None = None) -> int:
    """Challenges past their deadline with checkpoints still missing count as failed checks."""
    now = now or timezone.now()
    expired = 0
    for receipt in Receipt.objects.filter(status=Receipt.Status.PENDING, challenge_deadline__lt=now):
        if missing_boundaries(receipt):
            fail(receipt_id=receipt.pk, code="challenge_unanswered",
                 message=f"The checkpoints {missing_boundaries(receipt)} asked for were not uploaded in time.")
            expired += 1
    return expired

