"""Writes on devices and their work: registration, claims, heartbeats, results."""
from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone
from muninn_worker import tensors

from billing import services as billing
from jobs import services as jobs
from jobs import storage
from jobs.models import WorkUnit
from muninn.errors import Conflict, InvalidInput, NotFound, TooLarge

from . import selectors
from .authentication import token_hash, touch
from .checks import Expected, ResultRejected, check_receipt, check_state
from .models import Device, Lease, Receipt

log = logging.getLogger(__name__)
THROUGHPUT_SMOOTHING = 0.3  # weight of the newest measurement in the moving estimate


def device_register(*, owner, name: str, capabilities: dict) -> tuple[Device, str]:
    """A new device for a contributor. Returns it with its token, which is shown this once only."""
    token = secrets.token_urlsafe(32)
    gpu_memory = [g.get("memory_bytes", 0) for g in capabilities.get("gpus", [])]
    device = Device.objects.create(
        owner=owner, name=name, token_hash=token_hash(token), capabilities=capabilities,
        memory_bytes=max(gpu_memory + [capabilities.get("ram_bytes", 0)]),
        samples_per_s=float(capabilities.get("samples_per_s") or 0.0), last_seen_at=timezone.now(),
    )
    return device, token


@dataclass(frozen=True)
class Claim:
    unit: WorkUnit
    lease: Lease


def unit_claim(*, device: Device) -> Claim | None:
    """Lease the device one queued unit it can run, or None when there is nothing for it now."""
    touch(device)
    with transaction.atomic():
        unit = jobs.unit_lease(device_id=device.pk, memory_bytes=device.memory_bytes,
                               gpu=selectors.device_has_gpu(device))
        if unit is None:
            return None
        lease = Lease.objects.create(device=device, unit=unit, token=unit.lease_token)
    return Claim(WorkUnit.objects.select_related("round__job").get(pk=unit.pk), lease)


def leased_unit(*, device: Device, unit_id: int) -> tuple[WorkUnit, Lease]:
    """The unit, if the device holds its current lease (for downloads, heartbeats and results)."""
    unit = WorkUnit.objects.select_related("round__job").filter(pk=unit_id).first()
    if unit is None:
        raise NotFound(f"There is no unit {unit_id}.")
    lease = selectors.current_lease(device=device, unit=unit)
    if lease is None:
        if unit.status == WorkUnit.Status.ACCEPTED:
            raise Conflict("This unit already has an accepted result.", code="already_done")
        raise Conflict("This unit is not leased to this device (the lease expired, or it is someone else's).",
                       code="lease_lost")
    return unit, lease


def unit_heartbeat(*, device: Device, unit_id: int):
    touch(device)
    unit, lease = leased_unit(device=device, unit_id=unit_id)
    return jobs.unit_heartbeat(unit_id=unit.pk, lease_token=lease.token)


def _reject(*, unit: WorkUnit, device: Device, lease: Lease, receipt: dict, error: ResultRejected) -> None:
    Receipt.objects.create(unit=unit, device=device, lease=lease, status=Receipt.Status.REJECTED,
                           reason=f"{error.code}: {error.message}"[:500], payload=_jsonable(receipt))
    log.warning("device %s unit %s rejected: %s", device.pk, unit.pk, error.message)
    raise InvalidInput(error.message, code=error.code)


def _jsonable(receipt: dict) -> dict:
    return {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in receipt.items()}


def result_submit(*, device: Device, unit_id: int, weights: bytes, receipt: dict, max_bytes: int) -> Receipt:
    """Check a device's result for a unit it holds, then accept it and credit the work, all at once.

    A result that fails a check is refused with the reason (kept as a rejected receipt) and changes nothing
    else: the unit stays leased to the device until its lease runs out. Posting an accepted result again
    (a client retrying after a lost answer) returns the original receipt and credits nothing more."""
    touch(device)
    output_sha = storage.sha256_hex(weights)
    repeat = Receipt.objects.filter(unit_id=unit_id, device=device, status=Receipt.Status.ACCEPTED,
                                    output_sha256=output_sha).first()
    if repeat is not None:  # the same upload again (the first answer was lost on the way): same answer
        return repeat
    unit, lease = leased_unit(device=device, unit_id=unit_id)
    reference_bytes = storage.blob_get(unit.round.weights_sha256)
    if len(weights) > max(2 * len(reference_bytes) + 1_000_000, 0) or len(weights) > max_bytes:
        raise TooLarge(f"The upload is {len(weights):,} bytes; this unit's weights are {len(reference_bytes):,}.")
    expected = Expected(unit.pk, unit.round.weights_sha256, unit.shard_sha256, unit.samples)
    try:
        check_receipt(receipt, expected=expected, output_sha256=output_sha)
        try:
            state = tensors.bytes_to_state_dict(weights)
        except ValueError as e:
            raise ResultRejected("not_safetensors", f"The weights are not a safetensors file: {e}") from e
        check_state(state, tensors.bytes_to_state_dict(reference_bytes))
    except ResultRejected as e:
        _reject(unit=unit, device=device, lease=lease, receipt=receipt, error=e)

    storage.blob_put(weights)
    metrics = {"loss_before": receipt["loss_before"], "loss_after": receipt["loss_after"],
               "steps": receipt["steps"], "train_seconds": receipt["train_seconds"]}
    with transaction.atomic():
        unit, round_complete = jobs.unit_accept(unit_id=unit.pk, lease_token=lease.token, result_sha256=output_sha,
                                                samples=receipt["samples"], metrics=metrics)
        stored = Receipt.objects.create(
            unit=unit, device=device, lease=lease, status=Receipt.Status.ACCEPTED, payload=_jsonable(receipt),
            weights_sha256=receipt["weights_sha256"], shard_sha256=receipt["shard_sha256"],
            output_sha256=output_sha, samples=receipt["samples"], steps=receipt["steps"],
            loss_before=receipt["loss_before"], loss_after=receipt["loss_after"],
            train_seconds=receipt["train_seconds"], started_at=receipt["started_at"],
            finished_at=receipt["finished_at"],
        )
        billing.unit_charge(unit=unit, contributor=device.owner)
        _update_throughput(device, samples=receipt["samples"] * unit.round.job.hparams["epochs"],
                           seconds=receipt["train_seconds"])
        if round_complete:
            from jobs.tasks import aggregate_round

            transaction.on_commit(lambda: aggregate_round.delay(unit.round_id))
    return stored


def _update_throughput(device: Device, *, samples: int, seconds: float) -> None:
    if seconds <= 0:
        return
    measured = samples / seconds
    current = Device.objects.filter(pk=device.pk).values_list("samples_per_s", flat=True).first() or 0.0
    new = measured if current <= 0 else (1 - THROUGHPUT_SMOOTHING) * current + THROUGHPUT_SMOOTHING * measured
    Device.objects.filter(pk=device.pk).update(samples_per_s=new)
