"""The HTTP side of the worker protocol (docs/worker-protocol.md), one method per endpoint.

Every request goes through `call_with_retry`; error bodies `{"error": {"code", "message"}}` become
`ApiError`, and a server that stays unreachable becomes `NetworkError`, so callers handle one family.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import requests
from urllib3.filepost import encode_multipart_formdata

from muninn_worker import __version__
from muninn_worker.cache import ContentCache
from muninn_worker.failpoints import failpoint
from muninn_worker.retry import NETWORK_ERRORS, RetryHook, call_with_retry, retry_after_seconds
from muninn_worker.signing import sign

__all__ = ["ApiClient", "ApiError", "NetworkError", "DownloadProgress"]

DownloadProgress = Callable[[int, "int | None"], None]  # (bytes so far, total bytes or None)

_CHUNK = 1 << 20


class ApiError(Exception):
    """The site answered with an error status (or with something that is not the protocol)."""

    def __init__(self, status: int, code: str, message: str, detail: Any = None) -> None:
        super().__init__(f"{message} (HTTP {status} {code})")
        self.status = status
        self.code = code
        self.message = message
        self.detail = detail


class ClientTooOld(Exception):
    """The site answered 426: this client is older than it speaks to. Not an ApiError, so that no unit's error
    handling swallows it: the client says how to upgrade and stops."""

    def __init__(self, message: str, upgrade: str | None = None):
        super().__init__(message)
        self.message, self.upgrade = message, upgrade


class NetworkError(ApiError):
    """The site could not be reached (connection refused, DNS, timeouts) even after retrying."""

    def __init__(self, message: str) -> None:
        super().__init__(0, "unreachable", message)

    def __str__(self) -> str:
        return self.message


class ApiClient:
    def __init__(
        self,
        server_url: str,
        *,
        account_token: str | None = None,
        device_token: str | None = None,
        timeout: float | tuple[float, float] = (10.0, 120.0),
        attempts: int = 6,
        retry_sleep: Callable[[float], Any] = time.sleep,
        on_retry: RetryHook | None = None,
        signing_key: str | None = None,
    ) -> None:
        if not server_url.startswith(("http://", "https://")):
            raise ValueError(f"the server URL must start with http:// or https:// (got {server_url!r})")
        self.server_url = server_url.rstrip("/")
        self.account_token = account_token
        self.device_token = device_token
        self.timeout = timeout
        self.attempts = attempts
        self.retry_sleep = retry_sleep
        self.on_retry = on_retry
        self.signing_key = signing_key  # base64 Ed25519 private key: receipts are signed when it is set
        self.retry_after: float | None = None  # the last empty claim's Retry-After (see claim)
        # requests.Session is not thread-safe; the heartbeat thread gets its own.
        self._local = threading.local()

    # ------------------------------------------------------------------------------------ endpoints

    def register_device(self, name: str, capabilities: dict, public_key: str) -> dict:
        """POST /api/worker/devices → {"device_id", "device_token", "name"}."""
        response = self._request(
            "POST", "/api/worker/devices", auth="account",
            json={"name": name, "capabilities": capabilities, "public_key": public_key}, expected=(200, 201),
        )
        body = self._json(response)
        if not isinstance(body.get("device_token"), str) or "device_id" not in body:
            raise ApiError(response.status_code, "bad_response", "registration answer lacks device_id/device_token")
        return body

    def claim(self, wait: float = 0.0, backends: Sequence[str] | None = None) -> dict | None:
        """POST /api/worker/claim → the leased unit, or None when there is nothing to do (204).

        `wait` > 0 asks the site to hold the claim up to that many seconds until a unit is queued for this device
        (a long poll); a site that cannot hold it (too many claims held, or an older site) answers 204 at once.
        After a 204, `retry_after` is the site's Retry-After in seconds, or None when it sent none; with one, the
        connection is dropped, so that the next claim may reach another of the site's processes. `backends`
        (e.g. ["cuda"]) asks for work of those of the device's backends only."""
        self.retry_after = None
        timeout = _longer(self.timeout, wait)
        body: dict[str, Any] = {"wait": wait} if wait > 0 else {}
        if backends:
            body["backends"] = list(backends)
        response = self._request("POST", "/api/worker/claim", json=body, expected=(200, 204), timeout=timeout)
        if response.status_code == 204:
            self.retry_after = retry_after_seconds(response)
            if self.retry_after is not None:  # turned away by a full process: the next claim may find another
                self.reconnect()
            return None
        body = self._json(response)
        if isinstance(body.get("check"), dict):  # a peer check: re-train another device's segment
            return {**body["check"], "kind": "check"}
        unit = body.get("unit")
        if not isinstance(unit, dict):
            raise ApiError(response.status_code, "bad_response", "claim answer has no unit object")
        return unit

    def download(
        self,
        unit_id: int,
        kind: str,
        expected_sha256: str,
        cache_dir: str | os.PathLike[str],
        *,
        progress: DownloadProgress | None = None,
        scope: str = "units",
    ) -> bytes:
        """GET a unit's weights, shard or (LoRA) base weights (scope "checks": a peer check's start checkpoint,
        shard or base), through the content-addressed cache; the hash is always verified.

        Raises HashMismatch (a ValueError) when the body does not hash to `expected_sha256`.
        """
        if scope not in ("units", "checks") or kind not in ("weights", "shard", "base", "start"):
            raise ValueError(f"kind must be 'weights', 'shard', 'base' or 'start' (got {scope}/{kind!r})")
        cache = ContentCache(cache_dir)
        cached = cache.get(expected_sha256)
        if cached is not None:
            return cached
        url = f"{self.server_url}/api/worker/{scope}/{int(unit_id)}/{kind}"
        body: dict[str, bytes] = {}

        def attempt() -> requests.Response:
            response = self._session().get(url, headers=self._headers("device"), stream=True, timeout=self.timeout)
            try:
                if response.status_code != 200:
                    response.content  # noqa: B018 - read the small error body before the connection closes
                    return response
                body["data"] = cache.put(expected_sha256, _chunks(response, progress))
                return response
            finally:
                response.close()

        response = self._retry(attempt)
        if response.status_code != 200:
            raise _error_from(response)
        return body["data"]

    def heartbeat(self, unit_id: int) -> dict:
        """POST /api/worker/units/<id>/heartbeat → {"lease_expires_at"}; ApiError 409 if the lease is gone."""
        response = self._request("POST", f"/api/worker/units/{int(unit_id)}/heartbeat", json={})
        return self._json(response)

    def give_back(self, unit_id: int) -> bool:
        """POST /api/worker/units/<id>/release: this device will not finish the unit, so it is queued again at once
        for another device instead of waiting out the lease. One quick attempt, never raising: True when the
        site took it back (False: the lease was gone already, an older site, or no answer)."""
        try:
            response = self._session().post(f"{self.server_url}/api/worker/units/{int(unit_id)}/release",
                                            headers=self._headers("device"), timeout=5)
        except NETWORK_ERRORS:
            return False
        return response.status_code == 200

    def submit_result(self, unit_id: int, weights_bytes: bytes, receipt: dict, *,
                      checkpoint: bytes | None = None) -> dict:
        """POST the trained weights (multipart `weights`) with the JSON `receipt` and its signature, and the last
        checkpoint (`checkpoint`) when given: the site takes it if its challenge asks for it.

        Every attempt sends the same bytes (the same signature too), so a retry after a lost answer is
        recognised by the site as the same upload."""
        extra = {} if checkpoint is None else {"checkpoint": ("checkpoint.safetensors", checkpoint)}
        return self._upload(f"/api/worker/units/{int(unit_id)}/result", "weights",
                            ("weights.safetensors", weights_bytes), receipt=receipt, expected=(200, 201),
                            extra_files=extra)

    def upload_checkpoint(self, unit_id: int, boundary: int, data: bytes) -> dict:
        """POST a challenged checkpoint (multipart `checkpoint`) → {"unit", "status", "reason", "missing"}."""
        return self._upload(f"/api/worker/units/{int(unit_id)}/checkpoints/{int(boundary)}", "checkpoint",
                            ("checkpoint.safetensors", data), expected=(200,))

    def submit_check(self, check_id: int, checkpoint: bytes, receipt: dict) -> dict:
        """POST a peer check's end checkpoint with its signed receipt → {"check", "status"}."""
        return self._upload(f"/api/worker/checks/{int(check_id)}/result", "checkpoint",
                            ("checkpoint.safetensors", checkpoint), receipt=receipt, expected=(200, 201))

    def me(self) -> dict:
        """GET /api/worker/me → the device, its reputation, its units today and its owner's earnings."""
        return self._json(self._request("GET", "/api/worker/me"))

    def challenges(self) -> list[dict]:
        """GET /api/worker/challenges → the device's open challenges (checkpoints still missing)."""
        response = self._request("GET", "/api/worker/challenges")
        challenges = self._json(response).get("challenges")
        if not isinstance(challenges, list):
            raise ApiError(response.status_code, "bad_response", "challenges answer has no list")
        return challenges

    # ------------------------------------------------------------------------------------- plumbing

    def _upload(self, path: str, field: str, file: tuple[str, bytes], *, receipt: dict | None = None,
                expected: tuple[int, ...], extra_files: dict[str, tuple[str, bytes]] | None = None) -> dict:
        """A multipart POST of one file (and `extra_files`), with a JSON `receipt` and its Ed25519 signature when
        given."""
        fields: dict[str, Any] = {}
        if receipt is not None:
            text = json.dumps(receipt, allow_nan=False, separators=(",", ":"))
            fields["receipt"] = text
            if self.signing_key:
                fields["signature"] = sign(self.signing_key, text.encode())
        for name, part in {field: file, **(extra_files or {})}.items():
            fields[name] = (*part, "application/octet-stream")
        body, content_type = encode_multipart_formdata(fields)
        url = self.server_url + path
        headers = {**self._headers("device"), "Content-Type": content_type}
        # A fresh reader per attempt: a retry after a connection cut mid-body must send the whole body again.
        response = self._retry(
            lambda: self._session().post(url, data=_UploadBody(body), headers=headers, timeout=self.timeout)
        )
        if response.status_code not in expected:
            raise _error_from(response)
        return self._json(response)

    def _request(self, method: str, path: str, *, auth: str = "device", expected: tuple[int, ...] = (200,),
                 timeout: float | tuple[float, float] | None = None, **kwargs: Any) -> requests.Response:
        url = self.server_url + path
        headers = self._headers(auth)
        timeout = self.timeout if timeout is None else timeout
        response = self._retry(
            lambda: self._session().request(method, url, headers=headers, timeout=timeout, **kwargs)
        )
        if response.status_code == 426:
            error = _error_from(response)
            raise ClientTooOld(error.message, (error.detail or {}).get("upgrade"))
        if response.status_code not in expected:
            raise _error_from(response)
        return response

    def _retry(self, fn: Callable[[], requests.Response]) -> requests.Response:
        try:
            return call_with_retry(fn, attempts=self.attempts, sleep=self.retry_sleep, on_retry=self.on_retry)
        except NETWORK_ERRORS as exc:
            raise NetworkError(f"cannot reach {self.server_url}: {_short(exc)}") from exc

    def _headers(self, auth: str) -> dict[str, str]:
        if auth == "account":
            if not self.account_token:
                raise ValueError("registering a device needs the account token")
            authorization = f"Token {self.account_token}"
        else:
            if not self.device_token:
                raise ValueError("this call needs a device token; register the device first")
            authorization = f"Device {self.device_token}"
        return {"Authorization": authorization, "User-Agent": f"muninn-worker/{__version__}"}

    def reconnect(self) -> None:
        """Drop this thread's kept-alive connection: its next request opens a new one, which a site of several
        processes may hand to another process than the one that answered (a kept-alive connection stays with it)."""
        session = getattr(self._local, "session", None)
        if session is not None:
            self._local.session = None
            session.close()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    @staticmethod
    def _json(response: requests.Response) -> dict:
        try:
            body = response.json()
        except ValueError:
            raise ApiError(response.status_code, "bad_response", "the server did not answer with JSON") from None
        if not isinstance(body, dict):
            raise ApiError(response.status_code, "bad_response", "the server answered JSON that is not an object")
        return body


class _UploadBody:
    """An upload body read in blocks (requests sends a file-like object with a length as it reads it). Halfway
    through, the `upload.mid_body` failpoint: a fault test pauses there and kills the process, leaving the site
    with a truncated request."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._sent = 0
        self._paused = False

    def __len__(self) -> int:
        return len(self._data)

    def read(self, size: int = -1) -> bytes:
        half = len(self._data) // 2
        if self._sent == half and not self._paused:
            self._paused = True
            failpoint("upload.mid_body")
        end = len(self._data) if size is None or size < 0 else self._sent + size
        if self._sent < half:
            end = min(end, half)  # stop at the half, so that the failpoint pauses exactly there
        chunk = self._data[self._sent:end]
        self._sent += len(chunk)
        return chunk


def _chunks(response: requests.Response, progress: DownloadProgress | None) -> Iterator[bytes]:
    total = int(response.headers.get("Content-Length") or 0) or None
    done = 0
    for chunk in response.iter_content(_CHUNK):
        done += len(chunk)
        if progress is not None:
            progress(done, total)
        yield chunk


def _longer(timeout: float | tuple[float, float], wait: float) -> float | tuple[float, float]:
    """The read timeout of a claim held up to `wait` seconds: the usual one on top of the wait."""
    if wait <= 0:
        return timeout
    if isinstance(timeout, tuple):
        return (timeout[0], timeout[1] + wait)
    return (timeout, timeout + wait)


def _error_from(response: requests.Response) -> ApiError:
    """Map `{"error": {"code", "message", "detail"}}` to ApiError; fall back to the status line."""
    status = response.status_code
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and error.get("message"):
        return ApiError(status, str(error.get("code") or f"http_{status}"), str(error["message"]), error.get("detail"))
    text = (response.text or "").strip()
    message = text[:200] if text and not text.startswith("<") else (response.reason or "error")
    return ApiError(status, f"http_{status}", message)


def _short(exc: BaseException) -> str:
    """requests' connection errors nest urllib3 reprs; the last line is the useful part."""
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
