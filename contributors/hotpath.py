"""The worker API's two most frequent requests, claim and heartbeat, served ahead of the rest of Django's request
path: most of a busy site's requests are these, and for them the middleware after this one, the URL resolver and
DRF's request cycle (its Request, negotiation, rendering) were ~40 % of a heartbeat's CPU under load.

`WorkerHotPathMiddleware` (after BodyLimitMiddleware and SecurityMiddleware, whose limits and headers still apply)
answers what it can answer exactly as the API view would, and hands everything else to the rest of the chain:

- a heartbeat by the unit's holder (`POST /api/worker/units/<id>/heartbeat`): one statement on PostgreSQL, with
  the device's authentication, its last-seen touch and the lease's extension folded in (the device is not even
  read); a heartbeat it cannot extend (not the holder, an unknown or disabled token, no such unit) goes the full
  way, which answers it with the exact error;
- a claim (`POST /api/worker/claim`, an empty body or a JSON object): the same authentication, services and
  answers as `api.ClaimView` (push.unit_claim_wait), and the service's refusals in the API's error shape.

Both keep the API's rate limits (the same throttles, keyed by the device, so the two paths share one budget), the
worker client version check (a client too old goes the full way, to its 426), and anything unusual (another
authorization, a form or malformed body, a throttled device) goes the full way and gets its answer there. The
views stay what the OpenAPI schema documents; tests/test_worker_hotpath.py holds the two paths to the same
answers. On SQLite (the one-machine default) every request goes the full way: the fold needs PostgreSQL's
data-modifying WITH.
"""
from __future__ import annotations

import functools
import json
import re
import threading
from types import SimpleNamespace

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection
from django.http import HttpResponse
from django.utils import timezone
from rest_framework import exceptions

from jobs.models import WorkUnit
from muninn import sql
from muninn.errors import MuninnError, error_body
from muninn.throttles import ClaimThrottle, HeartbeatThrottle

from . import api, peers, push, versions
from .authentication import TOUCH_EVERY_S, DeviceTokenAuthentication, token_hash
from .models import Device

_HEARTBEAT = re.compile(r"/api/worker/units/([1-9][0-9]{0,18})/heartbeat")
_CLAIM = "/api/worker/claim"
MAX_ID = 2**63 - 1  # muninn/converters.py: a longer id matches no URL


class WorkerHotPathMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.method == "POST" and request.META.get("HTTP_AUTHORIZATION", "").startswith("Device "):
            path = request.path_info
            answer = None
            if path == _CLAIM:
                answer = _claim(request)
            elif path.endswith("/heartbeat") and connection.vendor == "postgresql":
                match = _HEARTBEAT.fullmatch(path)
                if match and int(match[1]) <= MAX_ID:
                    answer = _heartbeat(request, int(match[1]))
            if answer is not None:
                return answer
        return self.get_response(request)


def _json(payload: dict) -> HttpResponse:
    """As DRF's JSONRenderer writes it (compact, UTF-8)."""
    return HttpResponse(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode(),
                        content_type="application/json")


def _allowed(throttle_class, device_id: int) -> bool:
    """The view's throttle, on the same key (the device's id): False sends the request the full way, where DRF
    counts it again, refuses it and says how long to wait."""
    shim = SimpleNamespace(method="POST", auth=SimpleNamespace(pk=device_id))
    return throttle_class().allow_request(shim, None)


def _current_client(request) -> bool:
    return not versions.too_old(versions.client_version(request.META))


# --- Claims -----------------------------------------------------------------------------------------------

def _claim(request) -> HttpResponse | None:
    if not _current_client(request):
        return None
    data = _json_object(request)
    if data is None:
        return None
    try:
        found = DeviceTokenAuthentication().authenticate(request)
    except exceptions.AuthenticationFailed:
        return None
    if found is None or not _allowed(ClaimThrottle, found[1].pk):
        return None
    device = found[1]
    asked = SimpleNamespace(data=data, query_params=request.GET)  # what api.claim_wait and claim_backends read
    try:
        claim = push.unit_claim_wait(device=device, wait=api.claim_wait(asked), backends=api.claim_backends(asked))
    except push.WaitersFull as full:
        answer = HttpResponse(status=204)
        answer["Retry-After"] = str(full.retry_after)
        return answer
    except MuninnError as e:
        answer = _json(error_body(e.code, e.message, e.detail))
        answer.status_code = e.status
        return answer
    if claim is None:
        return HttpResponse(status=204)
    if claim.check is not None:
        return _json({"check": peers.check_payload(claim.check)})
    return _json({"unit": api.unit_payload(claim)})


def _json_object(request) -> dict | None:
    """The claim's body: {} when empty, else a JSON object; None (the full way: DRF parses forms, and says what
    is wrong with a body it cannot parse) for anything else."""
    body = request.body
    if not body.strip():
        return {}
    if request.content_type != "application/json":
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


# --- Heartbeats -------------------------------------------------------------------------------------------

_DEVICE_IDS: dict[str, int] = {}  # token hash → device id, per process: a token never moves to another device
_DEVICE_IDS_KEPT = 200_000
_ids_lock = threading.Lock()


def _heartbeat(request, unit_id: int) -> HttpResponse | None:
    if not _current_client(request):
        return None
    parts = request.META["HTTP_AUTHORIZATION"].split()
    if len(parts) != 2:
        return None
    hashed = token_hash(parts[1])
    device_id = _device_id(hashed)
    if device_id is None or not _allowed(HeartbeatThrottle, device_id):
        return None
    now = timezone.now()
    expires = now + timezone.timedelta(seconds=settings.MUNINN_LEASE_SECONDS)
    extended = sql.execute(_heartbeat_sql(), [
        device_id, hashed, sql.value(Device, "last_seen_at", now), device_id,
        sql.value(Device, "last_seen_at", now - timezone.timedelta(seconds=TOUCH_EVERY_S)),
        sql.value(WorkUnit, "lease_expires_at", expires), unit_id, WorkUnit.Status.LEASED])
    if not extended:
        return None
    return _json({"lease_expires_at": expires.isoformat().replace("+00:00", "Z"),
                  "lease_seconds": settings.MUNINN_LEASE_SECONDS})


def _device_id(hashed: str) -> int | None:
    """The id of the device this token hash belongs to (active or not: the heartbeat's statement checks that)."""
    device_id = _DEVICE_IDS.get(hashed)
    if device_id is None:
        row = sql.fetch_one(f"SELECT id FROM {sql.table(Device)} WHERE token_hash = %s", [hashed])
        if row is None:
            return None
        device_id = row[0]
        with _ids_lock:
            if len(_DEVICE_IDS) >= _DEVICE_IDS_KEPT:
                _DEVICE_IDS.clear()
            _DEVICE_IDS[hashed] = device_id
    return device_id


@functools.cache
def _heartbeat_sql() -> str:
    """The holder's heartbeat (jobs.services.leases.unit_heartbeat_holder) with the device's authentication
    (authentication.py: active, and its owner active) and its last-seen touch (authentication.touch: at most every
    TOUCH_EVERY_S) in one statement, written once (muninn/sql.py: why); its commit does not wait for the disk."""
    device, user, unit = sql.table(Device), sql.table(get_user_model()), sql.table(WorkUnit)
    return (f"WITH device AS (SELECT d.id FROM {device} d JOIN {user} u ON u.id = d.owner_id "
            f"WHERE d.id = %s AND d.token_hash = %s AND d.is_active AND u.is_active), "
            f"seen AS (UPDATE {device} SET last_seen_at = %s WHERE id = %s AND id IN (SELECT id FROM device) "
            f"AND (last_seen_at IS NULL OR last_seen_at < %s) RETURNING 1) "
            f"UPDATE {unit} SET lease_expires_at = %s WHERE id = %s AND status = %s "
            f"AND leased_device_id IN (SELECT id FROM device){sql.unflushed_returning('postgresql')}")
