"""Re-execution: the trusted side runs a unit again from the same inputs and seed and compares.

Local training is deterministic for a seed on CPU, so an honest result and its re-execution agree to
rounding (other CPUs and thread counts change the last bits only); a result that was not computed as
claimed does not. Runs in a Celery task on its own queue, inside the trust boundary.
"""
from __future__ import annotations

import logging

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from muninn_worker import codec, tensors, training

from jobs import services as jobs
from jobs import storage
from jobs.models import WorkUnit
from muninn.errors import Conflict
from muninn.failpoints import failpoint

from . import checks, results, services
from .checks import ResultRejected
from .models import Receipt

log = logging.getLogger(__name__)


def unit_verify(*, unit_id: int) -> Receipt | None:
    """Re-execute the unit's pending result and accept (and credit) or reject it. Idempotent: a unit with
    no pending result is left alone."""
    pending = (Receipt.objects.select_related("device", "unit__round__job")
               .filter(unit_id=unit_id, status=Receipt.Status.PENDING).first())
    if pending is None:
        return None
    unit, job = pending.unit, pending.unit.round.job
    if unit.status == WorkUnit.Status.CANCELLED:  # its shard's other copy was accepted first: nothing to check
        return _superseded(pending.pk)
    reference = tensors.bytes_to_state_dict(storage.blob_get(unit.round.weights_sha256))
    X, y = jobs.load_xy(unit.shard_sha256)
    recomputed = training.train_local(jobs.job_model(job, reference), X, y, **jobs.unit_train_spec(unit)).state_dict
    # Through the same encoding as the upload: an honest int8 result is compared with what honest int8 gives.
    recomputed = codec.roundtrip(recomputed, reference, job.update_encoding)
    submitted = tensors.bytes_to_state_dict(storage.blob_get(unit.result_sha256))
    distance = checks.reexecution_distance(submitted, recomputed, reference)

    with transaction.atomic():
        receipt = Receipt.objects.select_for_update().get(pk=pending.pk)
        if receipt.status != Receipt.Status.PENDING:
            return receipt
        receipt.verification = {**receipt.verification, "reexecution": {
            "distance": distance, "tolerance": settings.MUNINN_REEXECUTION_TOLERANCE,
            "at": timezone.now().isoformat()}}
        try:
            checks.check_reexecution(distance, settings.MUNINN_REEXECUTION_TOLERANCE)
        except ResultRejected as e:
            receipt.status, receipt.reason = Receipt.Status.REJECTED, f"{e.code}: {e.message}"[:500]
            receipt.save(update_fields=["status", "reason", "verification"])
            jobs.unit_reject(unit_id=unit.pk)
            services.device_record_failure(device=receipt.device, reason=receipt.reason)
            log.warning("unit %s from device %s failed re-execution: %s", unit.pk, receipt.device_id, e.message)
            return receipt
        try:
            unit, round_complete = jobs.unit_verified(unit_id=unit.pk)
        except Conflict as e:
            if e.code != "superseded":
                raise
            receipt.save(update_fields=["verification"])
            return _superseded(receipt.pk)
        receipt.status = Receipt.Status.ACCEPTED
        receipt.save(update_fields=["status", "verification"])
        results.credit(unit=unit, receipt=receipt)
        if round_complete:
            results.aggregate_on_commit(unit.round_id)
        failpoint("verify.before_commit")
    return receipt


def _superseded(receipt_id: int) -> Receipt:
    """The first valid result for the shard came from the other copy (straggler or backup): this receipt is
    kept, not credited, and not held against the device (it was not wrong, only late)."""
    with transaction.atomic():
        receipt = Receipt.objects.select_for_update().get(pk=receipt_id)
        if receipt.status == Receipt.Status.PENDING:
            receipt.status, receipt.reason = Receipt.Status.REJECTED, f"superseded: {jobs.SUPERSEDED}"[:500]
            receipt.save(update_fields=["status", "reason"])
    return receipt


def pending_units(*, older_than_s: float | None = None) -> list[int]:
    """Units whose re-execution has waited too long (a lost task; by default 2 × MUNINN_STALL_SECONDS): the sweep
    enqueues them again."""
    if older_than_s is None:
        older_than_s = 2 * settings.MUNINN_STALL_SECONDS
    cutoff = timezone.now() - timezone.timedelta(seconds=older_than_s)
    return list(Receipt.objects.filter(status=Receipt.Status.PENDING, created_at__lt=cutoff)
                .values_list("unit_id", flat=True))
