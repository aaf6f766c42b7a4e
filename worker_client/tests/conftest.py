"""A tiny fake Muninn site (stdlib http.server in a thread) that speaks docs/worker-protocol.md.

It is the HTTP boundary of the client, so the client's own code runs unmocked against it.
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from sklearn.datasets import load_digits

from muninn_worker.tensors import sha256_hex, shard_to_bytes, state_dict_to_bytes
from muninn_worker.zoo import init_state

ACCOUNT_TOKEN = "acct-token-0123456789"
DEVICE_TOKEN = "device-token-0123456789abcdef0123456789abcdef"
MODEL_CONFIG = {"in_features": 64, "num_classes": 10, "hidden": [32]}


def digits(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    X = torch.tensor(data.data[:samples], dtype=torch.float32)
    y = torch.tensor(data.target[:samples], dtype=torch.int64)
    return X, y


def global_weights(X: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    """Initial weights as the site makes them: seeded init, normalisation from the data."""
    state = init_state("mlp", MODEL_CONFIG, seed)
    state["norm_mean"] = X.mean(dim=0)
    std = X.std(dim=0)
    state["norm_std"] = torch.where(std > 0, std, torch.ones_like(std))
    return state


@dataclass
class FakeUnit:
    id: int
    weights: bytes
    shard: bytes
    samples: int
    train: dict
    lease_seconds: float = 60.0
    template: str = "mlp"
    model_config: dict = field(default_factory=lambda: dict(MODEL_CONFIG))
    base: bytes | None = None  # LoRA units: the frozen base weights served at /base
    algorithm: str = "fedavg"
    encoding: str = "fp32"  # how the result must be uploaded (muninn_worker.codec)

    def claim_body(self) -> dict:
        expires = datetime.now(timezone.utc) + timedelta(seconds=self.lease_seconds)
        return {"unit": {
            "id": self.id, "job": 3, "round": 2,
            "lease_expires_at": expires.isoformat().replace("+00:00", "Z"),
            "template": self.template, "model_config": self.model_config, "train": self.train,
            "weights_sha256": sha256_hex(self.weights), "shard_sha256": sha256_hex(self.shard),
            "samples": self.samples, "base_sha256": sha256_hex(self.base) if self.base else None,
            "algorithm": self.algorithm, "encoding": self.encoding,
        }}


@dataclass
class FakeSite:
    url: str = ""
    queue: list[FakeUnit] = field(default_factory=list)
    units: dict[int, FakeUnit] = field(default_factory=dict)
    results: list[dict] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    heartbeats: int = 0
    claim_statuses: list[int] = field(default_factory=list)  # forced statuses for the next claims
    claim_waits: list[float] = field(default_factory=list)  # the "wait" of every claim (0 when none was sent)
    claim_ports: list[int] = field(default_factory=list)  # the client's port of every claim: its connection
    claim_backends: list[list | None] = field(default_factory=list)  # the "backends" of every claim (None: none)
    claim_error_code: str = "forced"  # the error code of a forced claim status
    holds_claims: bool = False  # True: an empty claim is held for its wait until a unit is added (a long poll)
    held: int = 0  # claims being held now
    retry_after: str | None = None  # sent with every empty claim's 204
    changed: threading.Condition = field(default_factory=threading.Condition)
    heartbeat_status: int = 200
    result_status: int = 201
    # What the site says an accepted unit earned (contributors.api.credited_payload); {} as an older site would.
    result_money: dict = field(default_factory=lambda: {"earned_nanos": 86, "earned": "€0.000000086",
                                                        "currency": "EUR"})
    download_delay: float = 0.0
    corrupt_downloads: bool = False
    device_token: str = DEVICE_TOKEN
    account_token: str = ACCOUNT_TOKEN

    def add_unit(self, unit_id: int = 42, samples: int = 479, *, seed: int = 1234, epochs: int = 2,
                 lease_seconds: float = 60.0) -> FakeUnit:
        X, y = digits(samples)
        unit = FakeUnit(
            id=unit_id, weights=state_dict_to_bytes(global_weights(X)), shard=shard_to_bytes(X, y),
            samples=samples, lease_seconds=lease_seconds,
            train={"epochs": epochs, "batch_size": 32, "lr": 0.05, "momentum": 0.9, "seed": seed},
        )
        with self.changed:
            self.queue.append(unit)
            self.units[unit_id] = unit
            self.changed.notify_all()
        return unit

    def gets(self, suffix: str) -> int:
        return sum(1 for method, path in self.requests if method == "GET" and path.endswith(suffix))


def _handler(site: FakeSite) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep pytest output clean
            pass

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def _dispatch(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            site.requests.append((method, self.path))
            parts = self.path.strip("/").split("/")  # api, worker, ...
            if parts[:3] == ["api", "worker", "devices"] and method == "POST":
                return self._register(body)
            if self.headers.get("Authorization") != f"Device {site.device_token}":
                return self._error(401, "not_authenticated", "Invalid device token.")
            if parts[:3] == ["api", "worker", "claim"] and method == "POST":
                claim = json.loads(body or b"{}")
                site.claim_backends.append(claim.get("backends"))
                return self._claim(claim.get("wait", 0))
            if len(parts) == 5 and parts[2] == "units":
                unit = site.units.get(int(parts[3]))
                if unit is None:
                    return self._error(404, "not_found", "No such unit.")
                if parts[4] in ("weights", "shard", "base") and method == "GET":
                    return self._download(unit, parts[4])
                if parts[4] == "heartbeat" and method == "POST":
                    return self._heartbeat(unit)
                if parts[4] == "result" and method == "POST":
                    return self._result(unit, body)
            return self._error(404, "not_found", "No such endpoint.")

        def _register(self, body: bytes) -> None:
            if self.headers.get("Authorization") != f"Token {site.account_token}":
                return self._error(401, "not_authenticated", "Invalid account token.")
            payload = json.loads(body)
            needed = {"cpu_cores", "ram_bytes", "backends", "gpus", "torch_version", "samples_per_s", "flops_per_s"}
            if not needed <= set(payload.get("capabilities", {})):
                return self._error(400, "invalid", "Capabilities are incomplete.")
            self._json(201, {"device_id": 7, "device_token": site.device_token, "name": payload["name"]})

        def _claim(self, wait: float) -> None:
            site.claim_waits.append(wait)
            site.claim_ports.append(self.client_address[1])
            if site.claim_statuses:
                status = site.claim_statuses.pop(0)
                return self._error(status, site.claim_error_code, f"Forced status {status}.")
            with site.changed:
                if not site.queue and site.holds_claims and wait > 0:
                    site.held += 1
                    site.changed.notify_all()
                    site.changed.wait_for(lambda: site.queue, timeout=wait)
                    site.held -= 1
                unit = site.queue.pop(0) if site.queue else None
            if unit is None:
                return self._send(204, b"", "application/json")
            self._json(200, unit.claim_body())

        def _download(self, unit: FakeUnit, kind: str) -> None:
            time.sleep(site.download_delay)
            data = {"weights": unit.weights, "shard": unit.shard, "base": unit.base}[kind]
            if data is None:
                return self._error(404, "not_found", "This unit has no base weights.")
            if site.corrupt_downloads:
                data = data[:-1] + bytes([data[-1] ^ 1])
            self._send(200, data, "application/octet-stream")

        def _heartbeat(self, unit: FakeUnit) -> None:
            site.heartbeats += 1
            if site.heartbeat_status != 200:
                return self._error(site.heartbeat_status, "lease_lost", "The lease is no longer yours.")
            expires = datetime.now(timezone.utc) + timedelta(seconds=unit.lease_seconds)
            self._json(200, {"lease_expires_at": expires.isoformat()})

        def _result(self, unit: FakeUnit, body: bytes) -> None:
            fields = _multipart(self.headers["Content-Type"], body)
            site.results.append({"unit": unit.id, "weights": fields["weights"],
                                 "receipt": json.loads(fields["receipt"]), "receipt_bytes": fields["receipt"],
                                 "signature": fields.get("signature"), "checkpoint": fields.get("checkpoint")})
            if site.result_status != 201:
                return self._error(site.result_status, "bad_result", "Weights have the wrong shapes.")
            self._json(201, {"unit": unit.id, "status": "accepted", "credited_hu": "0.0000001234",
                             **site.result_money})

        def _error(self, status: int, code: str, message: str) -> None:
            self._json(status, {"error": {"code": code, "message": message, "detail": {}}})

        def _json(self, status: int, payload: dict) -> None:
            self._send(status, json.dumps(payload).encode(), "application/json")

        def _send(self, status: int, data: bytes, content_type: str) -> None:
            self.send_response(status)
            if status == 204 and site.retry_after is not None:
                self.send_header("Retry-After", site.retry_after)
            if status != 204:
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if status != 204:
                self.wfile.write(data)

    return Handler


def _multipart(content_type: str, body: bytes) -> dict[str, bytes]:
    """Parse multipart/form-data with the stdlib email parser (cgi is gone from newer Pythons)."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + body
    )
    return {part.get_param("name", header="content-disposition"): part.get_payload(decode=True)
            for part in message.iter_parts()}


@pytest.fixture
def fake_site() -> Iterator[FakeSite]:
    site = FakeSite()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(site))
    site.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield site
    server.shutdown()
    server.server_close()
