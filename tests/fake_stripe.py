"""A local fake of the parts of Stripe's HTTP API that Muninn calls, for the real `stripe` library to talk to,
and webhook payloads signed exactly as Stripe signs them. No test reaches the internet."""
from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl


def _nest(pairs: list[tuple[str, str]]) -> dict:
    """Stripe's form encoding (a[b][0][c]=v) back into nested dicts (lists stay dicts keyed "0", "1", ...)."""
    out: dict = {}
    for key, value in pairs:
        parts = key.replace("]", "").split("[")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


@dataclass
class Request:
    method: str
    path: str
    params: dict
    headers: dict


@dataclass
class FakeStripe:
    secret_key: str = "sk_test_muninn_fake"
    requests: list[Request] = field(default_factory=list)
    failing_destinations: set[str] = field(default_factory=set)  # transfers to these accounts are refused
    _idempotent: dict = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    base_url: str = ""

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.failing_destinations.clear()
            self._idempotent.clear()

    def calls(self, path: str) -> list[Request]:
        return [r for r in self.requests if r.path == path]

    # --- the API ------------------------------------------------------------------------------------
    def handle(self, method: str, path: str, params: dict, headers: dict) -> tuple[int, dict]:
        if headers.get("authorization") != f"Bearer {self.secret_key}":
            return 401, {"error": {"type": "invalid_request_error", "message": "Invalid API Key provided"}}
        key = headers.get("idempotency-key")
        with self._lock:
            self.requests.append(Request(method, path, params, headers))
            if key and (path, key) in self._idempotent:
                return self._idempotent[(path, key)]
            n = next(self._ids)
            answer = self._route(method, path, params, n)
            if key:
                self._idempotent[(path, key)] = answer
            return answer

    def _route(self, method: str, path: str, p: dict, n: int) -> tuple[int, dict]:
        if (method, path) == ("POST", "/v1/checkout/sessions"):
            item = p["line_items"]["0"]
            amount = int(item["price_data"]["unit_amount"]) * int(item.get("quantity", 1))
            sid = f"cs_test_{n:06d}"
            return 200, {"id": sid, "object": "checkout.session", "mode": p["mode"], "status": "open",
                         "payment_status": "unpaid", "amount_total": amount,
                         "currency": item["price_data"]["currency"], "client_reference_id": p.get("client_reference_id"),
                         "metadata": p.get("metadata", {}), "url": f"https://checkout.stripe.com/c/pay/{sid}"}
        if (method, path) == ("POST", "/v1/accounts"):
            return 200, {"id": f"acct_test{n:06d}", "object": "account", "type": p.get("type"),
                         "details_submitted": False, "payouts_enabled": False}
        if (method, path) == ("POST", "/v1/account_links"):
            return 200, {"object": "account_link", "url": f"https://connect.stripe.com/setup/e/{p['account']}/{n}",
                         "expires_at": int(time.time()) + 300}
        if (method, path) == ("POST", "/v1/transfers"):
            if p["destination"] in self.failing_destinations:
                return 400, {"error": {"type": "invalid_request_error", "code": "insufficient_capabilities_for_transfer",
                                       "message": "The destination account cannot receive transfers."}}
            return 200, {"id": f"tr_test{n:06d}", "object": "transfer", "amount": int(p["amount"]),
                         "currency": p["currency"], "destination": p["destination"], "metadata": p.get("metadata", {})}
        return 404, {"error": {"type": "invalid_request_error", "message": f"Unrecognized request URL ({method}: {path})"}}


def start_fake_stripe() -> tuple[FakeStripe, ThreadingHTTPServer]:
    fake = FakeStripe()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length).decode() if length else ""
            path, _, query = self.path.partition("?")
            params = _nest(parse_qsl(body or query, keep_blank_values=True))
            status, answer = fake.handle(self.command, path, params, {k.lower(): v for k, v in self.headers.items()})
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Request-Id", f"req_fake_{len(fake.requests)}")
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _serve

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    fake.base_url = f"http://127.0.0.1:{server.server_address[1]}"
    return fake, server


WEBHOOK_SECRET = "whsec_muninn_fake_secret"


def event(type_: str, obj: dict, *, event_id: str | None = None) -> dict:
    return {"id": event_id or f"evt_{hashlib.sha256(json.dumps([type_, obj, time.time_ns()]).encode()).hexdigest()[:24]}",
            "object": "event", "type": type_, "api_version": "2026-10-28.endive", "created": int(time.time()),
            "livemode": False, "data": {"object": obj}}


def signed(payload: dict | bytes, *, secret: str = WEBHOOK_SECRET, timestamp: int | None = None) -> tuple[bytes, str]:
    """The body and the Stripe-Signature header, as Stripe makes them: t=<unix time>,v1=HMAC-SHA256(secret, "t.body")."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    t = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return body, f"t={t},v1={mac}"
