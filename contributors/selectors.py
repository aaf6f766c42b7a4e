"""Reads on devices, leases and receipts."""
from datetime import timedelta

from django.conf import settings
from django.db.models import Count, QuerySet
from django.utils import timezone

from .models import Device, Lease, Receipt


def devices_online() -> QuerySet[Device]:
    since = timezone.now() - timedelta(seconds=settings.MUNINN_DEVICE_ONLINE_SECONDS)
    return Device.objects.filter(is_active=True, last_seen_at__gte=since)


def device_has_gpu(device: Device) -> bool:
    """A GPU-tier device: it reports a CUDA backend."""
    backends = (device.capabilities or {}).get("backends") or []
    return isinstance(backends, list) and "cuda" in backends


def device_capacities_online(*, min_memory_bytes: int = 0, gpu: bool = False) -> list[tuple[int, float]]:
    """(device id, measured samples/s) of the online devices that can run a job needing this much memory
    (and, for a GPU-tier template, a GPU)."""
    rows = devices_online().filter(memory_bytes__gte=min_memory_bytes).order_by("id")
    return [(d.pk, d.samples_per_s) for d in rows if not gpu or device_has_gpu(d)]


def devices_for(*, owner) -> QuerySet[Device]:
    return Device.objects.filter(owner=owner).order_by("id")


def current_lease(*, device: Device, unit) -> Lease | None:
    """The device's lease on the unit if it is still the unit's current one."""
    if unit.lease_token is None:
        return None
    return Lease.objects.filter(device=device, unit=unit, token=unit.lease_token).first()


def job_devices(*, job) -> list[dict]:
    rows = (Receipt.objects.filter(unit__round__job=job, status=Receipt.Status.ACCEPTED)
            .values("device_id", "device__name").annotate(units=Count("id")).order_by("device_id"))
    return [{"device": r["device_id"], "name": r["device__name"], "units": r["units"]} for r in rows]
