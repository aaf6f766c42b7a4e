"""Peer checks: a challenged segment re-trained by a second device of the same backend class, for backends the
site's validators do not run (MUNINN_VALIDATOR_BACKENDS). After BOINC's homogeneous redundancy: devices of one
kind agree bit for bit or within the measured tolerance. Two agreeing runs accept the segment; when they
disagree a third device decides, and the minority has failed. The peers are paid for that work as verified
work. When no peer takes a check within MUNINN_PEER_CHECK_SECONDS, the site's validator decides instead
(with the tolerance measured for other devices' arithmetic), so a lone device of a rare kind is never stuck.
"""
from __future__ import annotations

import functools
import logging
import time
from datetime import timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone
from muninn_worker import segments

from jobs import services as jobs
from jobs import storage
from jobs.models import WorkUnit
from muninn import sql
from muninn.errors import Conflict, InvalidInput, NotFound

from . import checks, credit, exposure, reputation, selectors, tolerances
from .models import Device, PeerCheck, Receipt

log = logging.getLogger(__name__)


def unit_backend(unit: WorkUnit) -> str:
    """The backend class the unit was trained on: the job's (GPU-tier templates train on CUDA)."""
    return unit.round.job.backend_list[0] if unit.round.job.backend_list else "cpu"


def site_validates(backend: str) -> bool:
    return backend in settings.MUNINN_VALIDATOR_BACKENDS


def peer_checks_create(*, receipt: Receipt) -> list[PeerCheck]:
    """One peer check per challenged segment (idempotent)."""
    backend = unit_backend(receipt.unit)
    with transaction.atomic():
        existing = {c.segment for c in receipt.peer_checks.filter(tie_break=False)}
        PeerCheck.objects.bulk_create([PeerCheck(receipt=receipt, segment=j, backend=backend)
                                       for j in receipt.challenge_segments if j not in existing])
    _queued()
    return list(receipt.peer_checks.all())


# Most claims find no peer check queued (the site's validators run the CPU tier's checks): a process that found
# none asks again only after this long, unless it queued one itself meanwhile (a check waits a moment longer).
# One thread asks while the process's others go on as if none were queued: under load the question takes several
# GIL waits, and every claim that arrived meanwhile asked it too (py-spy: ~2.5 % of the web's CPU in bench/load.py).
NONE_QUEUED_RECHECK_S = 0.5
_none_queued_until = 0.0


@functools.cache
def _any_queued_sql() -> str:
    return f"SELECT 1 FROM {sql.table(PeerCheck)} WHERE status = %s LIMIT 1"


def _maybe_queued() -> bool:
    global _none_queued_until
    now = time.monotonic()
    if now < _none_queued_until:
        return False
    _none_queued_until = now + NONE_QUEUED_RECHECK_S  # the others skip while this thread asks
    if sql.fetch_one(_any_queued_sql(), [PeerCheck.Status.QUEUED.value]) is not None:
        _none_queued_until = 0.0
        return True
    return False


def _queued() -> None:
    global _none_queued_until
    _none_queued_until = 0.0


def peer_check_lease(*, device: Device, backends=None) -> PeerCheck | None:
    """A queued peer check this device may run: its backend is among the device's, the device has a good record
    (TRUST_AFTER verified units in a row, and not a flagged owner's new device), and it is not the checked device, nor its owner's, nor a device that
    already ran this segment. A check of a sensitive dataset's unit only for a device the site trusts with such data
    (contributors.exposure): the peer downloads the same shard; one no trusted peer takes goes to the site's own
    validator when it expires (peer_checks_sweep)."""
    if device.quarantined_at is not None or device.verified_streak < reputation.TRUST_AFTER:
        return None
    if not _maybe_queued():
        return None
    if selectors.device_trust_streak(device) < reputation.TRUST_AFTER:  # a flagged owner's new device
        return None
    backends = list(selectors.device_resources(device, backends=backends))  # a claim may ask for fewer
    now = timezone.now()
    with transaction.atomic():
        candidates = (PeerCheck.objects.filter(status=PeerCheck.Status.QUEUED, backend__in=backends,
                                               receipt__status=Receipt.Status.PENDING)
                      .exclude(receipt__device__owner_id=device.owner_id).order_by("id"))
        if not exposure.device_is_trusted(device, now=now):
            candidates = candidates.filter(receipt__unit__round__job__dataset__sensitive=False)
        if connection.features.has_select_for_update_skip_locked:
            candidates = candidates.select_for_update(skip_locked=True, of=("self",))
        for check in candidates[:8]:
            ran = PeerCheck.objects.filter(receipt_id=check.receipt_id, segment=check.segment, device=device)
            if ran.exists():
                continue
            leased = PeerCheck.objects.filter(pk=check.pk, status=PeerCheck.Status.QUEUED).update(
                status=PeerCheck.Status.LEASED, device=device,
                lease_expires_at=now + timedelta(seconds=settings.MUNINN_LEASE_SECONDS))
            if leased:
                return PeerCheck.objects.select_related("receipt__unit__round__job").get(pk=check.pk)
    return None


def leased_check(*, device: Device, check_id: int) -> PeerCheck:
    check = PeerCheck.objects.select_related("receipt__unit__round__job").filter(pk=check_id).first()
    if check is None:
        raise NotFound(f"There is no peer check {check_id}.")
    if check.device_id != device.pk or check.status != PeerCheck.Status.LEASED:
        raise Conflict("This peer check is not leased to this device (expired, decided, or someone else's).",
                       code="lease_lost")
    return check


def check_payload(check: PeerCheck) -> dict:
    """What a peer device needs to re-train the segment (the claim's answer, as {"check": ...})."""
    receipt, unit = check.receipt, check.receipt.unit
    job = unit.round.job
    bounds = segments.boundaries(jobs.unit_steps(unit), receipt.segment_steps)
    return {
        "id": check.pk, "unit": unit.pk, "job": job.pk, "template": job.template, "model_config": job.model_config,
        "train": jobs.unit_train_spec(unit), "first_step": bounds[check.segment],
        "steps": bounds[check.segment + 1] - bounds[check.segment],
        "start_sha256": _start_sha(check), "shard_sha256": unit.shard_sha256,
        "base_sha256": job.base_weights.sha256 if job.base_weights_id else None,
        "lease_expires_at": check.lease_expires_at.isoformat().replace("+00:00", "Z"),
        "lease_seconds": settings.MUNINN_LEASE_SECONDS,
    }


def start_checkpoint_bytes(check: PeerCheck) -> bytes:
    """The segment's start: the checked device's own checkpoint (boundary 0: the global weights, fresh optimizer)."""
    if check.segment == 0:
        from .verification import first_checkpoint

        return segments.checkpoint_to_bytes(first_checkpoint(check.receipt))
    return storage.blob_get(check.receipt.checkpoint_blobs[str(check.segment)])


def _start_sha(check: PeerCheck) -> str:
    return storage.sha256_hex(start_checkpoint_bytes(check))


def peer_check_submit(*, device: Device, check_id: int, data: bytes, receipt: dict, receipt_bytes: bytes,
                      signature: str) -> PeerCheck:
    """The peer's end of the segment: signed, compared with the checked device's committed end."""
    check = leased_check(device=device, check_id=check_id)
    try:
        checks.check_signature(device.public_key, receipt_bytes, signature)
    except checks.ResultRejected as e:
        raise InvalidInput(e.message, code=e.code) from None
    if receipt.get("check") != check.pk:
        raise InvalidInput(f"The receipt is for check {receipt.get('check')}, posted to check {check.pk}.",
                           code="receipt_mismatch")
    try:
        end = segments.bytes_to_checkpoint(data)
    except segments.BadCheckpoint as e:
        raise InvalidInput(f"Not a checkpoint file: {e}.", code="bad_checkpoint") from None
    if receipt.get("end") != end.commitment():
        raise InvalidInput("The receipt's 'end' is not the commitment of the uploaded checkpoint.",
                           code="receipt_mismatch")
    original = check.receipt
    start = segments.bytes_to_checkpoint(start_checkpoint_bytes(check))
    committed = segments.bytes_to_checkpoint(storage.blob_get(original.checkpoint_blobs[str(check.segment + 1)]))
    try:
        distance = checks.checkpoint_distance(committed, end, start)
    except (KeyError, RuntimeError):
        distance = float("inf")
    tolerance = tolerances.tolerance(original.unit.round.job.template, original.segment_steps)
    with transaction.atomic():
        locked = PeerCheck.objects.select_for_update().get(pk=check.pk)
        if locked.status != PeerCheck.Status.LEASED or locked.device_id != device.pk:
            raise Conflict("This peer check is no longer leased to this device.", code="lease_lost")
        locked.distance = distance
        locked.result_sha256 = storage.blob_put(data)
        locked.status = PeerCheck.Status.AGREED if distance <= tolerance else PeerCheck.Status.DISAGREED
        locked.decided_at = timezone.now()
        locked.save(update_fields=["distance", "result_sha256", "status", "decided_at"])
    decide(receipt_id=original.pk)
    return PeerCheck.objects.get(pk=check.pk)


def decide(*, receipt_id: int) -> str | None:
    """Settle the checked receipt once every challenged segment has a verdict: the majority of the device and
    its peers. Returns "accepted", "rejected" or None (still waiting)."""
    from . import challenges, verification

    receipt = Receipt.objects.select_related("unit__round__job", "device").get(pk=receipt_id)
    if receipt.status != Receipt.Status.PENDING:
        return None
    verdicts, minority, majority = {}, [], []
    for j in receipt.challenge_segments:
        runs = {c.tie_break: c for c in receipt.peer_checks.filter(segment=j).exclude(
            status=PeerCheck.Status.EXPIRED)}
        first, third = runs.get(False), runs.get(True)
        if first is None or first.status in (PeerCheck.Status.QUEUED, PeerCheck.Status.LEASED):
            return None
        if first.status == PeerCheck.Status.AGREED:
            verdicts[j], majority = True, majority + [first]
            continue
        if third is None:  # two runs disagree: a third device decides
            PeerCheck.objects.create(receipt=receipt, segment=j, backend=first.backend, tie_break=True)
            _queued()
            return None
        if third.status in (PeerCheck.Status.QUEUED, PeerCheck.Status.LEASED):
            return None
        verdicts[j] = third.status == PeerCheck.Status.AGREED
        if verdicts[j]:  # the checked device and the third agree: the first peer was wrong
            majority, minority = majority + [third], minority + [first]
        else:  # both peers disagree with the checked device
            majority = majority + [first, third]
    evidence = {"passed": all(verdicts.values()), "validator": "peers", "segments": [
        {"segment": j, "agreed": verdicts[j]} for j in sorted(verdicts)], "at": timezone.now().isoformat(),
        "tolerance": tolerances.tolerance(receipt.unit.round.job.template, receipt.segment_steps),
        "segment_steps": receipt.segment_steps}
    for check in minority:
        from . import services

        services.device_record_failure(device=check.device, unit_id=receipt.unit_id,
                                       reason=f"reexecution_mismatch: its peer check of unit {receipt.unit_id} "
                                              f"segment {check.segment} disagreed with two other devices")
    for check in majority:
        credit.credit_peer_check(check=check)
    if evidence["passed"]:
        verification.accept(receipt, evidence)
        return "accepted"
    verification.record(receipt, evidence)
    challenges.fail(receipt_id=receipt.pk, code="reexecution_mismatch",
                    message="Two other devices of its kind re-trained a challenged segment and disagree with it.")
    return "rejected"


def peer_checks_sweep(*, now=None) -> list[int]:
    """Leases of peer checks past their expiry go back to the queue; checks no peer has taken within
    MUNINN_PEER_CHECK_SECONDS expire, and their units go to the site's validator. Returns those units."""
    now = now or timezone.now()
    if PeerCheck.objects.filter(status=PeerCheck.Status.LEASED, lease_expires_at__lt=now).update(
            status=PeerCheck.Status.QUEUED, device=None, lease_expires_at=None):
        _queued()
    cutoff = now - timedelta(seconds=settings.MUNINN_PEER_CHECK_SECONDS)
    stale = PeerCheck.objects.filter(Q(status=PeerCheck.Status.QUEUED), created_at__lt=cutoff)
    units = sorted(set(stale.values_list("receipt__unit_id", flat=True)))
    stale.update(status=PeerCheck.Status.EXPIRED, decided_at=now)
    return units
