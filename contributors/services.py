"""Writes on devices and their work: registration, claims, heartbeats, results."""
from __future__ import annotations

import functools
import logging
import secrets
from dataclasses import dataclass

from django.conf import settings
from django.db import DatabaseError, IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from billing import money
from jobs import selectors as job_selectors
from jobs import services as jobs
from jobs.models import WorkUnit
from muninn import sql
from muninn.errors import Conflict, InvalidInput, MuninnError, NotFound
from muninn.failpoints import failpoint

from . import browser, credit, exposure, peers, reputation, selectors, tolerances
from .authentication import token_hash, touch
from .models import Device, DeviceEvent, Lease, PeerCheck

log = logging.getLogger(__name__)


class PublicKeyTaken(Conflict):
    code = "public_key_taken"

    def __init__(self):
        super().__init__("This public key is already registered to a device. Generate a new key pair for each "
                         "device.")


class DeviceLimit(MuninnError):
    code = "too_many_devices"
    status = 403


def device_register(*, owner, name: str, capabilities: dict, public_key: str) -> tuple[Device, str]:
    """A new device for a contributor. Returns it with its token, which is shown this once only.

    An account has at most MUNINN_MAX_DEVICES_PER_ACCOUNT active devices (a contributor retires one by having it
    deactivated), and a public key signs for one device only: registering a key again, on any account, is
    refused. A contributor with a quarantined device gets the new one quarantined too, for the same review (its
    earnings stay held; staff lift it as any other): a fresh device must not be a way around a quarantine. A
    contributor whose device is flagged otherwise gets a new device with no trust (selectors.device_trust_streak)."""
    token = secrets.token_urlsafe(32)
    gpu_memory = [g.get("memory_bytes", 0) for g in capabilities.get("gpus", [])]
    with transaction.atomic():
        type(owner).objects.select_for_update().filter(pk=owner.pk).first()  # one registration per owner at a time
        if Device.objects.filter(public_key=public_key).exists():
            raise PublicKeyTaken()
        active = Device.objects.filter(owner=owner, is_active=True).count()
        if active >= settings.MUNINN_MAX_DEVICES_PER_ACCOUNT:
            raise DeviceLimit(f"This account already has {active} active devices, the most it may have. Ask "
                              "support to retire one you no longer use.",
                              detail={"limit": settings.MUNINN_MAX_DEVICES_PER_ACCOUNT})
        quarantined = Device.objects.filter(owner=owner, quarantined_at__isnull=False).order_by("id").first()
        try:
            with transaction.atomic():  # a savepoint: another owner's registration may take the key first
                device = Device.objects.create(
                    owner=owner, name=name, token_hash=token_hash(token), capabilities=capabilities,
                    public_key=public_key, memory_bytes=capabilities.get("ram_bytes", 0),
                    gpu_memory_bytes=max(gpu_memory, default=0),
                    flops_per_s=float(capabilities.get("flops_per_s") or 0.0),
                    samples_per_s=float(capabilities.get("samples_per_s") or 0.0), last_seen_at=timezone.now(),
                )
        except IntegrityError:  # the unique constraint on the key (contributors/0010) decided the race
            if not Device.objects.filter(public_key=public_key).exists():
                raise
            raise PublicKeyTaken() from None
        if quarantined is not None:
            device.quarantined_at = timezone.now()
            device.quarantine_reason = (f"registered while its owner's device #{quarantined.pk} is quarantined "
                                        f"({quarantined.quarantine_reason})")[:500]
            device.save(update_fields=["quarantined_at", "quarantine_reason"])
            DeviceEvent.objects.create(device=device, kind=DeviceEvent.Kind.QUARANTINED,
                                       reason=device.quarantine_reason)
    return device, token


@dataclass(frozen=True)
class Claim:
    unit: WorkUnit | None
    lease: Lease | None
    check: PeerCheck | None = None  # a peer check instead of a unit (contributors.peers)


class LeaseLimit(MuninnError):
    code = "lease_limit"
    status = 409


class Quarantined(MuninnError):
    code = "device_quarantined"
    status = 403


def unit_claim(*, device: Device, backends=None) -> Claim | None:
    """Lease the device a peer check it may run (checks hold up accepted work, so they come first), else one
    queued unit it can run, or None when there is nothing for it now. `backends` (e.g. ["cuda"]: an owner who
    lends only the GPU) narrows the work to those of the device's backends; none of them among its own is a 400."""
    touch(device)
    if device.quarantined_at is not None:
        raise Quarantined(f"This device is quarantined and gets no work: {device.quarantine_reason} "
                          "Contact support to have it reviewed.")
    resources = selectors.device_resources(device, backends=backends)
    if not resources:
        offered = list(selectors.device_resources(device))
        raise InvalidInput(f"This device was registered with {', '.join(offered)} only, so it has no "
                           f"{', '.join(backends)} work to claim. Register it again on this machine (muninn-worker "
                           "register) if it has that now.", code="bad_backends", detail={"offered": offered})
    # A browser re-trains no one's segments: peer checks are for devices of the checked unit's own arithmetic.
    check = None if browser.is_browser(device) else peers.peer_check_lease(device=device, backends=list(resources))
    if check is not None:
        return Claim(None, None, check)
    # Two statements and no transaction around them (its BEGIN and COMMIT were two more round trips on every
    # claim), each committed without waiting for the disk (muninn/sql.py: unflushed): the lease, then its Lease row.
    # A claim that dies between the two leaves a unit leased with no Lease row, which no heartbeat or result can
    # name (both need the row): its lease runs out and it is queued again, as a lease lost in a crash is.
    unit = jobs.unit_lease(device_id=device.pk, resources=resources, trusted=exposure.device_is_trusted(device),
                           templates=browser.templates_for(device))
    if unit is None:
        held = jobs.units_held(device_id=device.pk)
        if held >= settings.MUNINN_MAX_LEASES_PER_DEVICE:
            raise LeaseLimit(f"This device holds {held} units already, the most a device may hold at once. "
                             "Upload their results (or let their leases expire) before claiming more.",
                             detail={"held": held, "limit": settings.MUNINN_MAX_LEASES_PER_DEVICE})
        return None
    try:
        failpoint("claim.before_lease_row")
        k = tolerances.segment_steps_for(unit.round.job.template, jobs.unit_steps(unit))
        # one statement written once (muninn/sql.py): every claim writes one
        lease = sql.insert(Lease(device=device, unit=unit, token=unit.lease_token, segment_steps=k), unflushed=True)
    except Exception:
        _give_back_quietly(unit)  # at once, rather than when its lease runs out
        raise
    return Claim(unit, lease)


def _give_back_quietly(unit) -> None:
    try:
        jobs.unit_give_back(unit_id=unit.pk, lease_token=unit.lease_token)
    except DatabaseError:
        log.exception("unit %s: a claim failed after its lease and the unit could not be given back; it is "
                      "queued again when its lease runs out", unit.pk)


@functools.cache
def _leased_sql() -> str:
    """The device's current lease on a unit, with the unit, in one fixed statement (every download, every result
    and every heartbeat that is not the holder's runs it)."""
    return (f"SELECT {sql.columns(Lease, 'l')}, {sql.columns(WorkUnit, 'u')} FROM {sql.table(Lease)} l "
            f"JOIN {sql.table(WorkUnit)} u ON u.id = l.unit_id "
            "WHERE l.device_id = %s AND l.unit_id = %s AND u.lease_token = l.token")


def leased_from_row(device: Device, row) -> tuple[WorkUnit, Lease]:
    """(unit, lease) from a row of the lease's columns then the unit's (_leased_sql's, or the device's
    authentication's: authentication.DeviceTokenAuthentication.authenticate_with_lease)."""
    n = len(Lease._meta.concrete_fields)
    lease, unit = sql.instance(Lease, row[:n]), sql.instance(WorkUnit, row[n:])
    unit.round = job_selectors.round_fixed(unit.round_id)  # its fixed fields only: see there
    lease.unit, lease.device = unit, device
    return unit, lease


def leased_unit(*, device: Device, unit_id: int) -> tuple[WorkUnit, Lease]:
    """The unit, if the device holds its current lease (for downloads, heartbeats and results): one query when it
    does; anything else takes the slow path for the exact error."""
    row = sql.fetch_one(_leased_sql(), [device.pk, unit_id])
    if row is not None:
        return leased_from_row(device, row)
    unit = WorkUnit.objects.select_related("round__job").filter(pk=unit_id).first()
    if unit is None:
        raise NotFound(f"There is no unit {unit_id}.")
    lease = selectors.current_lease(device=device, unit=unit)
    if lease is None:
        if unit.status == WorkUnit.Status.ACCEPTED:
            raise Conflict("This unit already has an accepted result.", code="already_done")
        if unit.status == WorkUnit.Status.CANCELLED:
            raise Conflict("This unit was cancelled: its round closed, its job ended, or another device's result "
                           "for the same shard was accepted first. Nothing more is needed for it.",
                           code="unit_cancelled")
        raise Conflict("This unit is not leased to this device (the lease expired, or it is someone else's).",
                       code="lease_lost")
    return unit, lease


def unit_heartbeat(*, device: Device, unit_id: int):
    """Extend the device's lease on the unit. The common case, the holder's heartbeat, is one conditional update
    (the unit is leased, to this device); anything else takes the slow path for the exact error."""
    touch(device)
    expires = jobs.unit_heartbeat_holder(unit_id=unit_id, device_id=device.pk)
    if expires is not None:
        return expires
    unit, lease = leased_unit(device=device, unit_id=unit_id)
    return jobs.unit_heartbeat(unit_id=unit.pk, lease_token=lease.token)


def unit_give_back(*, device: Device, unit_id: int) -> None:
    """The device gives back a unit it holds and will not finish (POST .../release): queued again at once for
    another device (jobs.unit_give_back), instead of waiting out the lease. Unlike a lease left to expire this is
    not held against the device (devices_record_abandoned): it said so, and the round loses no time. Conflict
    (`lease_lost`, `already_done`, `unit_cancelled`) when the device does not hold it now."""
    unit, lease = leased_unit(device=device, unit_id=unit_id)
    if not jobs.unit_give_back(unit_id=unit.pk, lease_token=lease.token):
        raise Conflict("This unit is not leased to this device (the lease expired, or it is someone else's).",
                       code="lease_lost")
    log.info("device %s gave back unit %s", device.pk, unit.pk)


def devices_record_abandoned(abandoned: list[tuple[int, int]]) -> None:
    """Leases that expired without a result, [(unit id, device id), ...]: each is kept on its device's record, the
    device's verified streak is halved (it is checked more often again: a device that holds work and drops it is
    not one to trust blindly), and for MUNINN_ABANDON_COOLDOWN_SECONDS no shard is reserved for it at a round's
    planning (selectors.device_capacities_online); it still claims what nobody holds. Not a failure: machines
    crash, and nothing it sent was wrong."""
    if not abandoned:
        return
    DeviceEvent.objects.bulk_create([
        DeviceEvent(device_id=device_id, kind=DeviceEvent.Kind.ABANDONED, unit_id=unit_id,
                    reason=f"the lease of unit {unit_id} expired without a result")
        for unit_id, device_id in abandoned if device_id is not None])
    Device.objects.filter(pk__in={device_id for _, device_id in abandoned if device_id is not None}).update(
        verified_streak=F("verified_streak") / 2)


def device_record_failure(*, device: Device, reason: str, unit_id: int | None = None) -> bool:
    """A failure confirmed on `unit_id` (a segment re-trained differently, a checkpoint that is not what was
    committed, an unanswered challenge, a forged or inconsistent receipt): the streak resets and the earnings
    of its unverified work are held for review (reputation.HOLD_AFTER; staff release or forfeit them), and
    failures on QUARANTINE_AFTER distinct units since the last lifted quarantine quarantine the device. Checks
    that honest training can fail never come here: they send the result to a segment check instead. Returns
    True when this failure quarantined it."""
    with transaction.atomic():
        # Work accepted before this failure is credited first, as it would have been at once before credits were
        # batched: its streak counts before the reset, and its earnings are among those held below. Receipts
        # before the device row: the order a credit batch takes them in.
        credit.credit_pending(device_id=device.pk, wait=True)
        locked = Device.objects.select_for_update().get(pk=device.pk)
        locked.verified_streak, locked.failures = 0, locked.failures + 1
        DeviceEvent.objects.create(device=locked, kind=DeviceEvent.Kind.FAILURE, reason=reason[:500], unit_id=unit_id)
        failed = _failed_units(locked)
        quarantine = locked.quarantined_at is None and reputation.quarantine_due(failed)
        if quarantine:
            locked.quarantined_at = timezone.now()
            locked.quarantine_reason = f"failures confirmed on {failed} units; last: {reason}"[:500]
            DeviceEvent.objects.create(device=locked, kind=DeviceEvent.Kind.QUARANTINED,
                                       reason=locked.quarantine_reason)
            _hold_unverified_earnings(locked, f"device {locked.pk} quarantined: {locked.quarantine_reason}")
        elif reputation.hold_due(failed):
            where = f" on unit {unit_id}" if unit_id is not None else ""
            _hold_unverified_earnings(locked, f"device {locked.pk}: a failure confirmed{where}: {reason}"[:500])
        if quarantine or reputation.hold_due(failed):
            _flag_open_work(locked, unit_id, reason)
        locked.save(update_fields=["verified_streak", "failures", "quarantined_at", "quarantine_reason"])
    if quarantine:
        log.warning("device %s quarantined: %s", device.pk, reason)
    return quarantine


def _failed_units(device: Device) -> int:
    """Distinct units with a confirmed failure since the device's last lifted quarantine."""
    events = device.events.all()
    lifted = events.filter(kind=DeviceEvent.Kind.LIFTED).order_by("-id").values_list("id", flat=True).first()
    failures = events.filter(kind=DeviceEvent.Kind.FAILURE, id__gt=lifted or 0)
    return (failures.exclude(unit_id__isnull=True).values("unit_id").distinct().count()
            + failures.filter(unit_id__isnull=True).count())


def _hold_unverified_earnings(device: Device, reason: str) -> None:
    """A device quarantined: its accepted work that no validator checked is held for review until staff decide
    (released when the quarantine is lifted, or forfeited as fraud); its verified work keeps its earnings, and
    cleared earnings stay paid. Nothing is forfeited on a quarantine alone."""
    from billing import services as billing

    held = billing.earnings_hold_units(units=selectors.device_unverified_units(device), reason=reason)
    if held:
        amount = _moved(held)
        DeviceEvent.objects.create(device=device, kind=DeviceEvent.Kind.EARNINGS_HELD,
                                   reason=f"earnings of {len(held)} unverified unit(s) held for review "
                                          f"({_fmt(amount)})")


def _flag_open_work(device: Device, unit_id: int | None, reason: str) -> None:
    """A device caught on one unit: its other accepted updates whose earnings are still open are marked on their
    jobs (jobs.units_flag): left out of rounds not aggregated yet, and said to be in doubt where they were. Each
    passed a check of one segment (or, under a lowered check floor, none): that says little once the device is
    known to cheat."""
    caught = f"Device {device.pk} failed a check" + (f" on unit {unit_id}" if unit_id is not None else "")
    checked, unchecked = [], []
    for receipt in selectors.device_open_receipts(device).exclude(unit_id=unit_id).only("unit_id", "verification"):
        (checked if selectors.receipt_was_checked(receipt) else unchecked).append(receipt.unit_id)
    flagged = (jobs.units_flag(unit_ids=checked, reason=f"{caught} ({reason}); this update had passed a check of "
                                                         "one of its segments")
               + jobs.units_flag(unit_ids=unchecked, reason=f"{caught} ({reason}); this update was accepted "
                                                             "without a check"))
    if flagged:
        log.warning("device %s: %d accepted update(s) flagged on their jobs", device.pk, flagged)


def _unflag(device: Device) -> int:
    """Staff found the device honest: its updates are no longer in doubt."""
    return jobs.units_unflag(unit_ids=selectors.device_units(device).values_list("pk", flat=True))


def _moved(transactions) -> int:
    """How much the ledger transactions moved (the sum of their positive entries)."""
    return sum(e.amount for txn in transactions for e in txn.entries.all() if e.amount > 0)


def _fmt(nanos: int) -> str:
    """Amounts in memos and audit reasons are exact: they are the statement's details."""
    return money.format_money(nanos, settings.MUNINN_CURRENCY, exact=True)


def device_lift_quarantine(*, device: Device, staff, reason: str) -> Device:
    """Staff lift a quarantine after review; the device starts again as a new one (checked every time), and the
    earnings held while it was quarantined go back to pending, to clear as usual."""
    from billing import services as billing

    with transaction.atomic():
        locked = Device.objects.select_for_update().get(pk=device.pk)
        if locked.quarantined_at is None:
            raise Conflict("This device is not quarantined.", code="not_quarantined")
        locked.quarantined_at, locked.quarantine_reason = None, ""
        locked.failures = locked.verified_streak = 0
        locked.save(update_fields=["quarantined_at", "quarantine_reason", "failures", "verified_streak"])
        DeviceEvent.objects.create(device=locked, kind=DeviceEvent.Kind.LIFTED, reason=reason[:500], actor=staff)
        released = billing.earnings_release_held(units=selectors.device_units(locked), staff=staff,
                                                 reason=f"quarantine of device {locked.pk} lifted: {reason}")
        _unflag(locked)
        if released:
            amount = _moved(released)
            DeviceEvent.objects.create(device=locked, kind=DeviceEvent.Kind.RELEASED, actor=staff,
                                       reason=f"held earnings of {len(released)} unit(s) released ({_fmt(amount)})")
    return locked


def device_release_held_earnings(*, device: Device, staff, reason: str) -> list:
    """Staff reviewed a device's confirmed failure and found its held work honest (say, a challenge missed while
    the machine was off): the held earnings go back to pending and clear as usual. A quarantined device's are
    released by lifting its quarantine."""
    from billing import services as billing

    if not reason.strip():
        raise InvalidInput("Say why the held earnings are released: it is kept in the device's record.",
                           code="reason_required")
    with transaction.atomic():
        locked = Device.objects.select_for_update().get(pk=device.pk)
        if locked.quarantined_at is not None:
            raise Conflict("This device is quarantined: lifting the quarantine releases its held earnings.",
                           code="quarantined")
        released = billing.earnings_release_held(units=selectors.device_units(locked), staff=staff,
                                                 reason=f"device {locked.pk} reviewed: {reason}")
        unflagged = _unflag(locked)
        if not released and not unflagged:
            raise Conflict("This device has no earnings held for review.", code="nothing_held")
        amount = _moved(released)
        DeviceEvent.objects.create(device=locked, kind=DeviceEvent.Kind.RELEASED, actor=staff,
                                   reason=f"held earnings of {len(released)} unit(s) released ({_fmt(amount)}), "
                                          f"its updates no longer flagged: {reason}"[:500])
    return released


def device_forfeit_held_earnings(*, device: Device, staff, reason: str) -> list:
    """Staff decided the device's held work was fraudulent: its held earnings go back to the customers, and the
    contributor's statement says so. Only what is held (unverified work of a device with a confirmed failure) is
    forfeited."""
    from billing import services as billing

    if not reason.strip():
        raise InvalidInput("Say why the held earnings are forfeited: it is kept in the device's record and shown "
                           "on the contributor's statement.", code="reason_required")
    with transaction.atomic():
        locked = Device.objects.select_for_update().get(pk=device.pk)
        forfeits = billing.earnings_forfeit_held(units=selectors.device_units(locked), staff=staff, reason=reason)
        if not forfeits:
            raise Conflict("This device has no earnings held for review.", code="nothing_held")
        amount = _moved(forfeits)
        DeviceEvent.objects.create(device=locked, kind=DeviceEvent.Kind.FORFEITED, actor=staff,
                                   reason=f"held earnings of {len(forfeits)} unit(s) forfeited, {_fmt(amount)} "
                                          f"refunded: {reason}"[:500])
    return forfeits
