"""The sensitive-data tier: which devices may see a sensitive dataset's rows, and the record of every shard they took.

A customer marks a dataset sensitive at upload (jobs.models.Dataset.sensitive). Its jobs' units are leased only to
devices that meet the trust level staff set (models.ExposurePolicy, edited in the admin): a verified record, an
age, good standing, and optionally an owner staff approved (device_trusted). The same rule holds for peer checks,
which hand another device the same shard (peers.peer_check_lease); a sensitive segment no trusted peer takes is
re-trained by the site's own validator. Every download of such a shard is kept (ShardDownload) for the job page,
and checked again at download: a device that lost its standing since its lease gets nothing.

What the tier does not do: a trusted device sees the rows it trains on in plain (it must, to train), and what it
does with them after is outside the site's reach; the log says who had which rows and when.
"""
from __future__ import annotations

import io
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import Exists, OuterRef, Q, QuerySet
from django.db.models.signals import m2m_changed, post_save
from django.dispatch import receiver
from django.utils import timezone

from jobs import selectors as job_selectors
from jobs import services as jobs
from jobs.models import Job, WorkUnit
from muninn.errors import MuninnError

from .models import Device, DeviceEvent, ExposurePolicy, PeerCheck, ShardDownload


class NotTrusted(MuninnError):
    code = "not_trusted"
    status = 403


@dataclass(frozen=True)
class TrustPolicy:
    """ExposurePolicy as plain values (what device_trusted reads)."""

    min_verified_units: int = 20
    min_device_age_days: int = 7
    require_approved_owner: bool = False
    approved_owner_ids: frozenset[int] = field(default_factory=frozenset)


def device_trusted(device, policy: TrustPolicy, now: datetime) -> bool:
    """Whether the device may see sensitive rows under `policy` at `now`. Pure: it reads the device's fields only
    (`owner_flagged`, as the request's authentication or devices_annotated sets it, is read as given)."""
    if not device.is_active or device.quarantined_at is not None or device.failures > 0:
        return False
    if getattr(device, "owner_flagged", False):  # a flagged owner's new device (selectors.owner_flagged_before)
        return False
    if device.verified_total < policy.min_verified_units:
        return False
    if device.created_at is None or now - device.created_at < timedelta(days=policy.min_device_age_days):
        return False
    return not policy.require_approved_owner or device.owner_id in policy.approved_owner_ids


def policy_words(policy: TrustPolicy) -> str:
    """The rule in a sentence's words: "devices with at least 20 verified results, registered at least 7 days ago
    and in good standing"."""
    units = policy.min_verified_units
    days = policy.min_device_age_days
    parts = [f"at least {units} verified result{'s' if units != 1 else ''}" if units else "",
             f"registered at least {days} day{'s' if days != 1 else ''} ago" if days else ""]
    rule = "devices with " + ", ".join(p for p in parts if p) if any(parts) else "devices"
    rule += " in good standing (never quarantined since their last review, no failed check on record)"
    if policy.require_approved_owner:
        rule += ", whose owner staff approved for sensitive data"
    return rule


# The policy is read on every claim: kept in the process for a few seconds (a change made in the admin reaches the
# other processes within POLICY_TTL_S; the process that saved it forgets at once). When it is due, one thread reads
# it while the others go on with the last one: under load a read takes several GIL waits, and every claim that
# arrived meanwhile read it too (py-spy: ~3 % of the web's CPU in bench/load.py).
POLICY_TTL_S = 5.0
_policy: tuple[float, TrustPolicy] | None = None
_policy_lock = threading.Lock()


def policy_current() -> TrustPolicy:
    global _policy
    cached = _policy
    if cached is not None and time.monotonic() < cached[0]:
        return cached[1]
    if not _policy_lock.acquire(blocking=cached is None):
        return cached[1]  # another thread is reading it now
    try:
        if _policy is not None and _policy is not cached and time.monotonic() < _policy[0]:
            return _policy[1]  # read by the thread this one waited for
        row, _ = ExposurePolicy.objects.get_or_create(pk=1)
        owners = (frozenset(row.approved_owners.values_list("pk", flat=True)) if row.require_approved_owner
                  else frozenset())
        policy = TrustPolicy(row.min_verified_units, row.min_device_age_days, row.require_approved_owner, owners)
        _policy = (time.monotonic() + POLICY_TTL_S, policy)
        return policy
    finally:
        _policy_lock.release()


def policy_forget() -> None:
    global _policy
    _policy = None


@receiver(post_save, sender=ExposurePolicy, dispatch_uid="contributors.exposure.policy_saved")
@receiver(m2m_changed, sender=ExposurePolicy.approved_owners.through, dispatch_uid="contributors.exposure.owners")
def _policy_changed(**kwargs) -> None:
    policy_forget()


def device_is_trusted(device: Device, *, now: datetime | None = None) -> bool:
    """device_trusted under the current policy, with the device's owner_flagged looked up when it is not known."""
    if getattr(device, "owner_flagged", None) is None:
        from .selectors import owner_flagged_before

        device.owner_flagged = owner_flagged_before(device)
    return device_trusted(device, policy_current(), now or timezone.now())


def devices_annotated(devices: QuerySet[Device]) -> QuerySet[Device]:
    """The devices with `owner_flagged` (selectors.owner_flagged_before) computed in the query, for counting many."""
    failure_before = DeviceEvent.objects.filter(
        Q(device__quarantined_at__isnull=False) | Q(device__failures__gt=0), kind=DeviceEvent.Kind.FAILURE,
        device__owner_id=OuterRef("owner_id"), at__lt=OuterRef("created_at")).exclude(device_id=OuterRef("pk"))
    return devices.annotate(owner_flagged=Exists(failure_before))


def shard_download(*, device: Device, unit: WorkUnit, peer_check: PeerCheck | None = None):
    """The unit's shard as the device downloads it (a file object for FileResponse). A sensitive dataset's shard
    is served only to a device trusted now, opened from its sealed blob, and the download is recorded before it is
    served (a shard the site cannot open is not served, nor recorded: sealing.SealError); any other shard is its
    range of the round's pack, streamed (jobs.unit_shard_open)."""
    job: Job = unit.round.job
    key = job_selectors.job_data_key(job)
    if key is None:
        return jobs.unit_shard_open(unit, key=None)  # streamed, its hash checked as it goes
    if not device_is_trusted(device):
        raise NotTrusted("This shard belongs to a dataset its owner marked sensitive, and this device does not meet "
                         f"the site's trust level for such data now ({policy_words(policy_current())}).")
    shard = jobs.unit_shard_bytes(unit, key=key)
    ShardDownload.objects.create(device=device, owner_id=device.owner_id, job=job, unit=unit, peer_check=peer_check,
                                 shard_start=unit.shard_start, shard_stop=unit.shard_stop,
                                 shard_sha256=unit.shard_sha256)
    return io.BytesIO(shard)
