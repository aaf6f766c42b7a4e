"""Reads on devices, leases and receipts."""
import hashlib
import hmac
from datetime import timedelta

from django.conf import settings
from django.db.models import Count, Q, QuerySet
from django.utils import timezone
from muninn_worker import certificate, segments

from billing import money
from billing import selectors as ledger
from billing.models import Account
from jobs.models import WorkUnit

from . import browser, exposure
from .models import Device, DeviceEvent, Lease, PeerCheck, Receipt, ShardDownload


def devices_online() -> QuerySet[Device]:
    since = timezone.now() - timedelta(seconds=settings.MUNINN_DEVICE_ONLINE_SECONDS)
    return Device.objects.filter(is_active=True, last_seen_at__gte=since)


def devices_available() -> QuerySet[Device]:
    """Online and not quarantined: the devices that may be given work."""
    return devices_online().filter(quarantined_at__isnull=True)


def owner_flagged_before(device: Device) -> bool:
    """Whether the device was registered after a failure confirmed on another of its owner's devices that is
    still flagged (quarantined, or with failures not yet cleared by a lifted quarantine): a cheater's fresh
    device earns no trust while the old one's case is open. A device from the request's authentication has it
    already (authentication._device_sql)."""
    known = getattr(device, "owner_flagged", None)
    if known is not None:
        return bool(known)
    flagged = Device.objects.filter(owner_id=device.owner_id).exclude(pk=device.pk).filter(
        Q(quarantined_at__isnull=False) | Q(failures__gt=0))
    return DeviceEvent.objects.filter(device__in=flagged, kind=DeviceEvent.Kind.FAILURE,
                                      at__lt=device.created_at).exists()


def device_trust_streak(device: Device) -> int:
    """The verified streak the re-execution rate is drawn from: the device's own, or none at all (checked every
    time) for a device of a flagged owner (owner_flagged_before)."""
    if device.verified_streak == 0 or owner_flagged_before(device):
        return 0
    return device.verified_streak


def device_resources(device: Device, *, backends=None) -> dict[str, int]:
    """The backends the device offers, each with the memory a unit may use on it: RAM for the CPU (and for
    Apple MPS, whose memory is unified), the largest GPU's memory for CUDA. `backends`: only those of them (what a
    claim asks for, e.g. ["cuda"] from a client run with --gpu-only)."""
    offered = (device.capabilities or {}).get("backends") or ["cpu"]
    if browser.is_browser(device):  # CPU-class work, of the templates a browser trains (contributors.browser)
        resources = {"cpu": browser.memory_for(device)}
        return {b: memory for b, memory in resources.items() if backends is None or b in backends}
    resources = {"cpu": device.memory_bytes}
    if "cuda" in offered and device.gpu_memory_bytes > 0:
        resources["cuda"] = device.gpu_memory_bytes
    if "mps" in offered:
        resources["mps"] = device.memory_bytes
    if backends is not None:
        resources = {b: memory for b, memory in resources.items() if b in backends}
    return resources


def can_run(device: Device, *, min_memory_bytes: int, backends, template: str | None = None) -> bool:
    templates = browser.templates_for(device)
    if template is not None and templates is not None and template not in templates:
        return False
    resources = device_resources(device)
    return any(resources.get(b, -1) >= min_memory_bytes for b in backends)


def device_capacities_online(*, min_memory_bytes: int = 0, backends=("cpu",),
                             trusted_only: bool = False, template: str | None = None) -> list[tuple[int, float]]:
    """(device id, FLOP/s) of the online devices that can run a job needing this much memory on one of these
    backends. A probe's benchmark is only a guess, and a self-reported one (a busy machine measures itself ten
    times slower; a hoarder reports 1e18 to be sized the biggest shards), so a device with no verified unit yet
    counts at the median speed of those measured on real units, or, when none is, at the median of the probes:
    never at its own word. A device that let a lease expire within MUNINN_ABANDON_COOLDOWN_SECONDS is left out
    (no shard is reserved for it; it claims what nobody holds). `trusted_only`: the devices a sensitive dataset's
    shards may go to (contributors.exposure), for its rounds' plans."""
    now = timezone.now()
    since = now - timedelta(seconds=settings.MUNINN_ABANDON_COOLDOWN_SECONDS)
    abandoned = set(DeviceEvent.objects.filter(kind=DeviceEvent.Kind.ABANDONED, at__gte=since)
                    .values_list("device_id", flat=True))
    available = devices_available().order_by("id")
    if trusted_only:
        policy = exposure.policy_current()
        available = [d for d in exposure.devices_annotated(available) if exposure.device_trusted(d, policy, now)]
    rows = [d for d in available
            if d.pk not in abandoned and can_run(d, min_memory_bytes=min_memory_bytes, backends=backends,
                                                 template=template)]
    measured = sorted(d.flops_per_s for d in rows if d.verified_total > 0 and d.flops_per_s > 0)
    probes = sorted(d.flops_per_s for d in rows if d.verified_total == 0)
    guess = measured[len(measured) // 2] if measured else (probes[len(probes) // 2] if probes else None)
    return [(d.pk, d.flops_per_s if d.verified_total > 0 else guess) for d in rows]


def capable_devices_seen(*, min_memory_bytes: int, backends, template: str | None = None) -> int:
    """How many unquarantined devices able to run a job with these needs (of this template: a browser trains a
    few) were seen within MUNINN_DEVICE_RECENT_SECONDS (online now or lately): none means a job of this kind
    would likely wait."""
    since = timezone.now() - timedelta(seconds=settings.MUNINN_DEVICE_RECENT_SECONDS)
    seen = Device.objects.filter(is_active=True, quarantined_at__isnull=True, last_seen_at__gte=since)
    return sum(1 for d in seen if can_run(d, min_memory_bytes=min_memory_bytes, backends=backends, template=template))


def capacity_for(*, min_memory_bytes: int, backends, sensitive: bool = False, template: str | None = None) -> dict:
    """What the devices online offer a job with these needs, enough to tell its customer why it waits:
    `available` online and unquarantined devices, `capable` of them able to run it, `busy` of those holding a
    lease right now; `quarantined` online but quarantined devices, `quarantined_capable` of them able to run
    it; and the most RAM / GPU memory an available device offers. `sensitive`: the job's dataset is, so only
    the capable devices the site trusts with such data count as `capable` (and `busy`); `untrusted_capable` says how
    many more could run it, and `trust_rule` is the rule in words (contributors.exposure). `template`: the job's,
    which a browser may not train (contributors.browser)."""
    online = list(exposure.devices_annotated(devices_online()) if sensitive else devices_online())
    available = [d for d in online if d.quarantined_at is None]
    capable = [d for d in available
               if can_run(d, min_memory_bytes=min_memory_bytes, backends=backends, template=template)]
    extra = {}
    if sensitive:
        policy, now = exposure.policy_current(), timezone.now()
        trusted = [d for d in capable if exposure.device_trusted(d, policy, now)]
        extra = {"untrusted_capable": len(capable) - len(trusted), "trust_rule": exposure.policy_words(policy)}
        capable = trusted
    capable = [d.pk for d in capable]
    busy = (WorkUnit.objects.filter(status=WorkUnit.Status.LEASED, leased_device_id__in=capable)
            .values("leased_device_id").distinct().count()) if capable else 0
    quarantined = [d for d in online if d.quarantined_at is not None]
    return {**extra, "capable": len(capable), "busy": busy, "available": len(available),
            "quarantined": len(quarantined),
            "quarantined_capable": sum(1 for d in quarantined
                                       if can_run(d, min_memory_bytes=min_memory_bytes, backends=backends,
                                                  template=template)),
            "max_ram_bytes": max((d.memory_bytes for d in available), default=0),
            "max_gpu_memory_bytes": max((d.gpu_memory_bytes for d in available), default=0),
            "with_cuda": sum(1 for d in available if "cuda" in device_resources(d))}


def device_by_id(*, device_id: int) -> Device | None:
    """Any device by id (for staff tools; a contributor's own devices come from `devices_for`)."""
    return Device.objects.filter(pk=device_id).first()


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


SHARD_DOWNLOADS_LISTED = 1000


def job_shard_downloads(*, job, limit: int = SHARD_DOWNLOADS_LISTED) -> dict:
    """The job's shard-download log (contributors.exposure), as its customer reads it: the newest `limit` downloads
    with who (device id, owner's username), when and which rows of the job's training split, and how many in all."""
    rows = (ShardDownload.objects.filter(job=job).order_by("-at", "-id")
            .values("at", "device_id", "owner__username", "unit__round__number", "unit_id", "peer_check_id",
                    "shard_start", "shard_stop")[:limit])
    return {"job": job.pk, "sensitive": job.dataset.sensitive,
            "trust_rule": exposure.policy_words(exposure.policy_current()),
            "count": ShardDownload.objects.filter(job=job).count(),
            "downloads": [{"at": _iso(r["at"]), "device": r["device_id"], "owner": r["owner__username"],
                           "round": r["unit__round__number"], "unit": r["unit_id"], "check": r["peer_check_id"],
                           "shard_start": r["shard_start"], "shard_stop": r["shard_stop"]} for r in rows]}


def receipt_was_checked(receipt: Receipt) -> bool:
    """Whether a validator checked the result and it passed: a "reexecution" or "segment_check" entry in its
    verification with "passed": true, or (receipts from before "passed" was recorded) a re-execution whose
    distance was within its tolerance. Accepted without any such check is unverified. The one place that says
    what counts as verified."""
    verification = receipt.verification or {}
    for key in ("reexecution", "segment_check"):
        check = verification.get(key)
        if not isinstance(check, dict):
            continue
        if "passed" in check:
            if check["passed"] is True:
                return True
        elif key == "reexecution" and isinstance(check.get("distance"), (int, float)) \
                and isinstance(check.get("tolerance"), (int, float)) and check["distance"] <= check["tolerance"]:
            return True
    return False


def device_pseudonym(device_id: int) -> str:
    """How a certificate names a device: HMAC-SHA256 of its id under the site's secret, 32 hex digits. The same
    device reads the same on every certificate of the site; without the secret it names no device and no owner."""
    return hmac.new(settings.SECRET_KEY.encode(), f"muninn-device:{device_id}".encode(),
                    hashlib.sha256).hexdigest()[:32]


def job_units_evidence(job) -> dict[int, dict]:
    """What a job's certificate says of each accepted unit's result, by unit id: its device (a pseudonym), the
    receipt's sha256 (of its canonical JSON), the uploaded update's sha256, the optimizer steps it trained, and how
    it was verified (receipt_verification)."""
    receipts = Receipt.objects.filter(unit__round__job=job, status=Receipt.Status.ACCEPTED)
    return {r.unit_id: {"device": device_pseudonym(r.device_id),
                        "receipt_sha256": hashlib.sha256(certificate.canonical(r.payload)).hexdigest(),
                        "output_sha256": r.output_sha256, "steps": r.steps, "segment_steps": r.segment_steps,
                        "verification": receipt_verification(r)} for r in receipts}


def receipt_verification(receipt: Receipt) -> dict:
    """How an accepted result was verified: "site_reexecution" (the site's validator re-trained segments of it, or
    the whole unit, and agreed), "peer_check" (devices of its backend did, named by pseudonym), or "cheap_checks"
    (signature, hashes, shapes, finite values, update norm, loss on its shard, timing: nothing re-trained). With
    the re-trained step ranges [first, last) and their total. receipt_was_checked decides what counts."""
    if not receipt_was_checked(receipt):
        return {"method": "cheap_checks", "segments": [], "retrained_steps": 0}
    check = (receipt.verification or {}).get("segment_check")
    if not (isinstance(check, dict) and check.get("passed") is True):  # an older whole-unit re-execution
        return {"method": "site_reexecution", "segments": [[0, receipt.steps]], "retrained_steps": receipt.steps}
    k = check.get("segment_steps") or receipt.segment_steps
    bounds = segments.boundaries(receipt.steps, k)
    spans = [list(s.get("steps") or bounds[s["segment"]:s["segment"] + 2]) for s in check.get("segments") or []]
    out = {"method": "site_reexecution", "segments": spans, "retrained_steps": sum(b - a for a, b in spans),
           "tolerance": check.get("tolerance")}
    opinions = [{"segment": s["segment"], "passed_by": s["second_opinion"]["passed_by"]}
                for s in check.get("segments") or [] if isinstance(s.get("second_opinion"), dict)]
    if opinions:  # segments outside the tolerance that another honest arithmetic accepted (verification.py)
        out["second_opinions"] = opinions
    if check.get("validator") == "peers":
        agreed = receipt.peer_checks.filter(status=PeerCheck.Status.AGREED).values_list("device_id", flat=True)
        out.update(method="peer_check", peers=sorted({device_pseudonym(d) for d in agreed}))
    return out


def device_units(device: Device) -> QuerySet[WorkUnit]:
    """The units whose accepted result came from the device: the work its earnings are for."""
    return WorkUnit.objects.filter(receipts__device=device, receipts__status=Receipt.Status.ACCEPTED).distinct()


def device_open_receipts(device: Device) -> QuerySet[Receipt]:
    """The device's accepted results whose earnings have neither cleared nor been forfeited yet."""
    return Receipt.objects.filter(device=device, status=Receipt.Status.ACCEPTED,
                                  unit_id__in=ledger.units_with_open_earnings(units=device_units(device)))


def device_unverified_units(device: Device) -> QuerySet[WorkUnit]:
    """The device's accepted units that no validator checked and whose earnings have not cleared yet."""
    return WorkUnit.objects.filter(pk__in=[r.unit_id for r in device_open_receipts(device).only("unit_id", "verification")
                                           if not receipt_was_checked(r)])


def device_earnings_held(device: Device) -> int:
    """How much of the device's earnings is held for review now."""
    return ledger.earnings_held(units=device_units(device))


def devices_quarantined_with_held() -> list[dict]:
    """Every quarantined device, newest quarantine first, with what it holds for review: [{device, held}]."""
    return [{"device": d, "held": device_earnings_held(d)}
            for d in Device.objects.filter(quarantined_at__isnull=False).select_related("owner")
            .order_by("-quarantined_at")]


def devices_holding_earnings() -> list[dict]:
    """Devices not quarantined that hold earnings for review after a confirmed failure: [{device, held}]."""
    rows = ({"device": d, "held": device_earnings_held(d)}
            for d in Device.objects.filter(quarantined_at__isnull=True, events__kind=DeviceEvent.Kind.EARNINGS_HELD)
            .distinct().select_related("owner").order_by("-pk"))
    return [row for row in rows if row["held"]]


def units_leased_twice(*, lease_seconds: float | None = None) -> list[int]:
    """Units whose Lease rows overlap in time: each a real double lease. A lease is valid from its creation until
    its receipt (the result that ended it), or else until it expires; heartbeats only make that longer, so this is
    a floor on each lease's validity and any overlap found is real. For benches and tests, not the hot path."""
    base = timedelta(seconds=settings.MUNINN_LEASE_SECONDS if lease_seconds is None else lease_seconds)
    multi = list(Lease.objects.values("unit_id").annotate(n=Count("id")).filter(n__gt=1)
                 .values_list("unit_id", flat=True))
    ends = dict(Receipt.objects.filter(lease__unit_id__in=multi).values_list("lease_id", "created_at"))
    doubles = []
    for unit_id in multi:
        leases = list(Lease.objects.filter(unit_id=unit_id).order_by("created_at", "id"))
        if any(b.created_at < ends.get(a.pk, a.created_at + base) for a, b in zip(leases, leases[1:])):
            doubles.append(unit_id)
    return doubles


def device_status(*, device: Device, now=None) -> dict:
    """The device as its owner sees it (GET /api/worker/me, `muninn-worker status`): what it is, its reputation
    (verified streak and total, quarantined and why), its results since the start of the site's day by outcome
    with what the accepted ones earned, and its owner's earnings as the contributor page shows them (the
    account's, all devices together)."""
    now = now or timezone.now()
    day_start = timezone.localtime(now).replace(hour=0, minute=0, second=0, microsecond=0)
    today = Receipt.objects.filter(device=device, created_at__gte=day_start)
    by_status = dict(today.values_list("status").annotate(n=Count("id")).order_by())
    earned = ledger.units_earned(units=today.filter(status=Receipt.Status.ACCEPTED).values("unit_id"))
    balances = ledger.balances_for(user=device.owner_id)
    currency = settings.MUNINN_CURRENCY

    def amount(name: str, nanos: int) -> dict:  # as a result's answer says money: in nanos, and as shown
        return {f"{name}_nanos": nanos, name: money.format_money(nanos, currency)}

    backends = [browser.BACKEND] if browser.is_browser(device) else list(device_resources(device))
    return {
        "device": {"id": device.pk, "name": device.name, "backends": backends,
                   "registered_at": _iso(device.created_at), "last_seen_at": _iso(device.last_seen_at)},
        "reputation": {"verified_streak": device.verified_streak, "verified_total": device.verified_total,
                       "failures": device.failures, "quarantined": device.quarantined_at is not None,
                       "quarantined_at": _iso(device.quarantined_at), "quarantine_reason": device.quarantine_reason},
        "today": {"since": _iso(day_start), **{status: by_status.get(status, 0) for status in Receipt.Status.values},
                  **amount("earned", earned)},
        "earnings": {"currency": currency,
                     **amount("pending", balances.get(Account.Kind.CONTRIBUTOR_PENDING, 0)),
                     **amount("held", balances.get(Account.Kind.CONTRIBUTOR_HELD, 0)),
                     **amount("available", balances.get(Account.Kind.CONTRIBUTOR_AVAILABLE, 0))},
    }


def _iso(moment) -> str | None:
    return None if moment is None else moment.isoformat().replace("+00:00", "Z")
