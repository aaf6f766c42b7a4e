"""The worker API's three most frequent requests, claim, heartbeat and result, served ahead of the rest of Django's
request path: a busy site's requests are nearly all these, and the middleware after this one, the URL resolver
and DRF's request cycle (its Request, negotiation, parsers, rendering) were ~40 % of a heartbeat's CPU under load
and ~1 ms of a result's.

`WorkerHotPathMiddleware` (after BodyLimitMiddleware and SecurityMiddleware, whose limits and headers still apply)
answers what it can answer exactly as the API view would, and hands everything else to the rest of the chain:

- a heartbeat by the unit's holder (`POST /api/worker/units/<id>/heartbeat`): one statement on PostgreSQL, with
  the device's authentication, its last-seen touch and the lease's extension folded in (the device is not even
  read); a heartbeat it cannot extend (not the holder, an unknown or disabled token, no such unit) goes the full
  way, which answers it with the exact error;
- a claim (`POST /api/worker/claim`, an empty body or a JSON object): the same authentication, services and
  answers as `api.ClaimView` (push.unit_claim_wait), and the service's refusals in the API's error shape;
- a small result (`POST /api/worker/units/<id>/result`, a plain multipart form within FILE_UPLOAD_MAX_MEMORY_SIZE):
  the form read here, then `api.result_answer`, what ResultView runs on the form DRF's parser read; any form this
  does not read exactly as Django would (a file without a name, a charset, another header, a field twice or one
  the result does not have) goes the full way.

All three keep the API's rate limits (claims and heartbeats: the same throttles, keyed by the device, so the two
paths share one budget; results have none) and the worker client version check (a client too old goes the full
way, to its 426); anything unusual (another authorization, a form or malformed body, a throttled device) goes the
full way and gets its answer there. The views stay what the OpenAPI schema documents; tests/test_worker_hotpath.py
holds the two paths to the same answers. On SQLite (the one-machine default) heartbeats go the full way: their
fold needs PostgreSQL's data-modifying WITH; claims and results take the hot path there too.
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

from . import api, peers, push, results, services, versions
from .authentication import TOUCH_EVERY_S, DeviceTokenAuthentication, token_hash
from .models import Device

_HEARTBEAT = re.compile(r"/api/worker/units/([1-9][0-9]{0,18})/heartbeat")
_RESULT = re.compile(r"/api/worker/units/([1-9][0-9]{0,18})/result")
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
            elif path.endswith("/result"):
                match = _RESULT.fullmatch(path)
                if match and int(match[1]) <= MAX_ID:
                    answer = _result(request, int(match[1]))
            if answer is not None:
                return answer
        return self.get_response(request)


def _json(payload: dict, status: int = 200) -> HttpResponse:
    """As DRF's JSONRenderer writes it (compact, UTF-8)."""
    return HttpResponse(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode(),
                        content_type="application/json", status=status)


def _refused(error: MuninnError) -> HttpResponse:
    """A service's refusal in the API's error shape, as muninn.errors.api_exception_handler answers it."""
    return _json(error_body(error.code, error.message, error.detail), error.status)


def _device(request) -> Device | None:
    """The request's device, authenticated as the views' DeviceTokenAuthentication does; None for anything it
    would refuse or not take (the full way answers those)."""
    try:
        found = DeviceTokenAuthentication().authenticate(request)
    except exceptions.AuthenticationFailed:
        return None
    return None if found is None else found[1]


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
    device = _device(request)
    if device is None or not _allowed(ClaimThrottle, device.pk):
        return None
    asked = SimpleNamespace(data=data, query_params=request.GET)  # what api.claim_wait and claim_backends read
    try:
        claim = push.unit_claim_wait(device=device, wait=api.claim_wait(asked), backends=api.claim_backends(asked))
    except push.WaitersFull as full:
        answer = HttpResponse(status=204)
        answer["Retry-After"] = str(full.retry_after)
        return answer
    except MuninnError as e:
        return _refused(e)
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
        device_id, hashed, sql.value(Device, "last_seen_at", now),
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
            f"seen AS (UPDATE {device} SET last_seen_at = %s WHERE id IN (SELECT id FROM device) "
            f"AND (last_seen_at IS NULL OR last_seen_at < %s) RETURNING 1) "
            f"UPDATE {unit} SET lease_expires_at = %s WHERE id = %s AND status = %s "
            f"AND leased_device_id IN (SELECT id FROM device){sql.unflushed_returning('postgresql')}")


# --- Results ----------------------------------------------------------------------------------------------

class Part:
    """A file part of a small result's form, read: what api.result_answer reads of an uploaded file."""

    def __init__(self, data: bytes) -> None:
        self.data, self.size = data, len(data)

    def read(self) -> bytes:
        return self.data


_RESULT_FIELDS = {"weights": True, "checkpoint": True, "receipt": False, "signature": False}  # name → a file?
# A file's name as Django keeps it (an empty or path-like one makes Django drop the part: the full way says so)
_DISPOSITION = re.compile(r'form-data; name="([a-z]+)"(?:; filename="(?!\.\.?")[A-Za-z0-9._-]+")?')


def _result(request, unit_id: int) -> HttpResponse | None:
    """A small result (its whole form within FILE_UPLOAD_MAX_MEMORY_SIZE, which Django keeps in memory too):
    api.result_answer on the form read here. A form this does not read exactly goes the full way (DRF's parser),
    which still finds the body: Django keeps what was read."""
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return None
    boundary = _boundary(request.META.get("CONTENT_TYPE", ""))
    if boundary is None or not 0 < length <= settings.FILE_UPLOAD_MAX_MEMORY_SIZE or not _current_client(request):
        return None
    try:  # the device and its lease on the unit, in one statement
        found = DeviceTokenAuthentication().authenticate_with_lease(request, unit_id)
    except exceptions.AuthenticationFailed:
        return None
    if found is None:
        return None
    _, device, row = found
    leased = None if row is None else services.leased_from_row(device, row)  # None: result_submit says why
    try:
        # Before the body is read, as ResultView: a result can be no larger than an update of the unit's weights.
        results.result_body_check(device=device, unit_id=unit_id, content_length=length)
        form = _form(request.body, boundary)
        if form is None:
            return None
        payload = api.result_answer(device=device, unit_id=unit_id, upload=form.get("weights"),
                                    offered=form.get("checkpoint"), receipt_text=form.get("receipt") or "",
                                    signature=str(form.get("signature") or ""), leased=leased)
    except MuninnError as e:
        return _refused(e)
    return _json(payload, 201)


def _boundary(content_type: str) -> bytes | None:
    """The form's boundary; None for anything but multipart/form-data with one, and with its fields in UTF-8 (what
    Django decodes them with, unless the request names another charset)."""
    kind, *params = content_type.split(";")
    if kind.strip().lower() != "multipart/form-data":
        return None
    named = {}
    for param in params:
        name, _, value = param.strip().partition("=")
        named[name.strip().lower()] = value.strip().strip('"')
    boundary = named.pop("boundary", "")
    if named.pop("charset", "utf-8").lower() not in ("utf-8", "utf8") or named or not 0 < len(boundary) <= 200:
        return None
    return boundary.encode("latin-1", errors="replace")


def _form(body: bytes, boundary: bytes) -> dict | None:
    """The result's parts ({name: Part or str}) from a multipart/form-data body, or None when it is anything but a
    plain one: each part a Content-Disposition naming one of the result's fields once (its files with a filename,
    its text fields without), and at most a Content-Type beside it."""
    delimiter = b"--" + boundary
    if not body.startswith(delimiter + b"\r\n"):
        return None
    end = body.rfind(b"\r\n" + delimiter + b"--")
    if end < 0 or body[end + len(delimiter) + 4:].strip(b"\r\n"):
        return None
    form: dict = {}
    for chunk in body[len(delimiter) + 2:end].split(b"\r\n" + delimiter + b"\r\n"):
        head, separator, value = chunk.partition(b"\r\n\r\n")
        if not separator:
            return None
        disposition, typed = None, 0
        for line in head.decode("latin-1").split("\r\n"):
            name, _, text = line.partition(":")
            name = name.strip().lower()
            if name == "content-disposition" and disposition is None:
                disposition = _DISPOSITION.fullmatch(text.strip())
            elif name == "content-type" and not typed:
                typed = 1
            else:
                return None
        if disposition is None or disposition[1] not in _RESULT_FIELDS or disposition[1] in form:
            return None
        is_file = "filename=" in disposition[0]
        if is_file != _RESULT_FIELDS[disposition[1]]:
            return None
        if is_file:
            form[disposition[1]] = Part(value)
        else:
            try:
                form[disposition[1]] = value.decode()
            except UnicodeDecodeError:
                return None
    return form
