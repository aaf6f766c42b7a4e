"""Contributor pages (install the worker client, devices, earnings, payouts) and the staff's pages (the payout
review queue with its evidence, device moderation). Thin doors into the services; the payout decision itself
is made on the admin's review page (contributors/admin.py), which these pages link to."""
from __future__ import annotations

import logging

from datetime import timedelta
from decimal import Decimal

from django.conf import settings
from django.contrib import messages
from django.http import FileResponse, Http404, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from accounts import services as accounts
from accounts.pages import role_required
from billing import money, payouts
from billing import selectors as ledger
from billing import stripe_gateway
from billing.forms import AmountForm
from billing.models import Account
from jobs.models import Job
from jobs.selectors import job_waiting_reason
from muninn.errors import MuninnError

from . import browser, install, reputation, selectors, services, wheel
from .admin import payout_evidence
from .models import Device, DeviceEvent

log = logging.getLogger(__name__)

# "Held for review" is earnings of a quarantined device's unverified work, waiting for staff; "payout in review"
# is a payout the contributor asked for, waiting for staff. Two different reviews, two names.
EARNINGS = (("pending", Account.Kind.CONTRIBUTOR_PENDING), ("held for review", Account.Kind.CONTRIBUTOR_HELD),
            ("available", Account.Kind.CONTRIBUTOR_AVAILABLE), ("payout in review", Account.Kind.CONTRIBUTOR_IN_REVIEW),
            ("paid out", Account.Kind.CONTRIBUTOR_PAID_OUT))


def device_state(device: Device, now=None) -> str:
    """quarantined, inactive, online (seen within MUNINN_DEVICE_ONLINE_SECONDS) or offline."""
    if device.quarantined_at:
        return "quarantined"
    if not device.is_active:
        return "inactive"
    since = (now or timezone.now()) - timedelta(seconds=settings.MUNINN_DEVICE_ONLINE_SECONDS)
    return "online" if device.last_seen_at and device.last_seen_at >= since else "offline"


def _whole_cents(nanos: int) -> Decimal:
    """What can be paid out of `nanos`: whole minor units (cents), as an amount in the currency."""
    step = money.nanos_per_minor(settings.MUNINN_CURRENCY)
    return (Decimal(nanos // step * step) / Decimal(10**9)).quantize(Decimal("0.01"))


def _server_url(request) -> str:
    return request.build_absolute_uri("/").rstrip("/")


@role_required("contributor")
def contribute(request):
    user = request.user
    now = timezone.now()
    devices = [{"device": d, "state": device_state(d, now), "caps": d.capabilities or {},
                "events": list(d.events.all()[:3]),
                "held": selectors.device_earnings_held(d) if d.quarantined_at else 0}
               for d in selectors.devices_for(owner=user).prefetch_related("events")]
    balances = ledger.balances_for(user=user)
    context = {
        "server": _server_url(request), "token": accounts.token_for(user=user), "devices": devices,
        "install": {"python": install.PYTHON, "commands": "\n".join(install.commands(_server_url(request))),
                    "run": install.RUN},
        "earnings": [(label, balances.get(kind, 0)) for label, kind in EARNINGS],
        "payouts": ledger.payouts_for(contributor=user)[:50], "payout_account": ledger.payout_account_for(
            contributor=user), "stripe_enabled": stripe_gateway.is_configured(),
        "payout_min": settings.MUNINN_PAYOUT_MIN, "currency": settings.MUNINN_CURRENCY,
        "form": AmountForm(initial={"amount": _whole_cents(balances.get(Account.Kind.CONTRIBUTOR_AVAILABLE, 0))}),
    }
    return render(request, "contributors/contribute.html", context)


@role_required("contributor")
def contribute_browser(request):
    """Contribute with this browser: the page registers it as a device with the account token (as the worker
    client's register command does) and runs the worker loop in JavaScript (static/muninn/browser/)."""
    return render(request, "contributors/browser.html", {
        "token": accounts.token_for(user=request.user), "templates": browser.TEMPLATES,
        "max_memory": browser.MAX_MEMORY_BYTES})


@require_POST
@role_required("contributor")
def payout_onboarding(request):
    """Send the contributor to Stripe's hosted Connect onboarding."""
    try:
        url = payouts.payout_account_onboard(contributor=request.user)
    except MuninnError as e:
        messages.error(request, e.message)
        return redirect("contribute")
    return redirect(url)


@require_POST
@role_required("contributor")
def payout_request(request):
    form = AmountForm(request.POST)
    if not form.is_valid():
        messages.error(request, " ".join(form.errors["amount"]))
        return redirect("contribute")
    try:
        payout = payouts.payout_request(contributor=request.user, amount=money.to_nanos(form.cleaned_data["amount"]))
    except MuninnError as e:
        messages.error(request, e.message)
    else:
        messages.success(request, f"Payout {payout.pk} of {money.format_money(payout.amount, payout.currency)} "
                                  "requested: staff review it, then Stripe transfers it to your account.")
    return redirect("contribute")


def job_devices_panel(job: Job) -> dict:
    """For the job page (passed in by muninn/urls.py): the devices whose work was accepted for the job and,
    when no online device can run it, why (in place of the page's note on what the job waits for)."""
    panel = {"devices": selectors.job_devices(job=job)}
    waiting = job_waiting_reason(job, selectors.capacity_for)
    if waiting:
        panel["note"] = waiting
    return panel


SHARD_DOWNLOADS_SHOWN = 100


def job_exposure_section(job: Job) -> dict:
    """For the job page (passed in by muninn/urls.py): a sensitive job's shard-download log, the newest first."""
    if not job.dataset.sensitive:
        return {}
    return {"shard_downloads": selectors.job_shard_downloads(job=job, limit=SHARD_DOWNLOADS_SHOWN)}


# --- Staff ------------------------------------------------------------------------------------------

@role_required("staff")
def staff_home(request):
    """The payout review queue with a summary of the evidence beside each request (the full evidence and the
    decision are on the admin's review page), and the devices that need moderation."""
    queue = []
    for payout in ledger.payouts_requested():
        evidence = payout_evidence(payout)
        devices = list(evidence["devices"])
        queue.append({
            "payout": payout, "amount": money.format_money(payout.amount, payout.currency),
            "review_url": reverse("admin:billing_payout_review", args=[payout.pk]),
            "devices": devices, "quarantined": sum(1 for d in devices if d.quarantined_at),
            "accepted": sum(d.accepted for d in devices), "rejected": sum(d.rejected for d in devices),
            "units": len(evidence["charges"]),
            "balances": [(Account.Kind(kind).label, value) for kind, value in evidence["balances"]],
            "payout_account": evidence["payout_account"], "earlier": len(evidence["earlier"]),
        })
    quarantined, under_review = selectors.devices_quarantined_with_held(), selectors.devices_holding_earnings()
    events = DeviceEvent.objects.select_related("device", "actor").order_by("-at", "-id")[:30]
    return render(request, "contributors/staff.html", {"queue": queue, "quarantined": quarantined,
                                                        "under_review": under_review, "events": events,
                                                        "quarantine_after": reputation.QUARANTINE_AFTER})


@require_POST
@role_required("staff")
def device_lift_quarantine(request, device_id: int):
    device = get_object_or_404(Device, pk=device_id)
    reason = request.POST.get("reason", "").strip()
    if not reason:
        messages.error(request, "Say why the quarantine is lifted: it is kept in the device's record.")
        return redirect("staff-home")
    try:
        services.device_lift_quarantine(device=device, staff=request.user, reason=reason)
    except MuninnError as e:
        messages.error(request, e.message)
    else:
        messages.success(request, f"Lifted the quarantine of {device.name} (#{device.pk}).")
    return redirect("staff-home")


def _held_earnings_decision(request, device_id: int, decide, done) -> HttpResponse:
    """A staff decision on a device's held earnings: `decide(device=, staff=, reason=)` is the service, `done`
    says what it did."""
    device = get_object_or_404(Device, pk=device_id)
    try:
        moved = decide(device=device, staff=request.user, reason=request.POST.get("reason", ""))
    except MuninnError as e:
        messages.error(request, e.message)
    else:
        messages.success(request, done(device, len(moved)))
    return redirect("staff-home")


@require_POST
@role_required("staff")
def device_release_held(request, device_id: int):
    """Staff found a device's held work honest after a confirmed failure: its held earnings go back to pending."""
    return _held_earnings_decision(request, device_id, services.device_release_held_earnings, lambda device, n: (
        f"Released the held earnings of {n} unit(s) of {device.name} (#{device.pk})."))


@require_POST
@role_required("staff")
def device_forfeit_held(request, device_id: int):
    """Staff decided a device's held work was fraudulent: its held earnings go back to the customers."""
    return _held_earnings_decision(request, device_id, services.device_forfeit_held_earnings, lambda device, n: (
        f"Forfeited the held earnings of {n} unit(s) of {device.name} (#{device.pk}) and refunded the customers."))


def worker_wheel(request, filename: str):
    """The worker client's wheel (contributors/wheel.py), public: what `pip install <site>/downloads/<wheel>`
    fetches. Any other file name is a 404."""
    if filename != wheel.wheel_name():
        raise Http404("No such download.")
    try:
        path = wheel.wheel_path()
    except wheel.WheelUnavailable as e:
        log.error("worker wheel: %s", e)
        return HttpResponse("The worker client cannot be downloaded right now; try again later.", status=503,
                            content_type="text/plain")
    return FileResponse(open(path, "rb"), as_attachment=True, filename=filename,
                        content_type="application/octet-stream")
