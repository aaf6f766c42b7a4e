"""Fixtures shared by the site's tests: users, a funded customer, devices, and a simulated device that does
real training in-process through the worker API (the end-to-end tests use real processes instead)."""
from __future__ import annotations

import io
import json
import tempfile
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import numpy as np
import pytest
from django.utils import timezone
from muninn_worker import codec, segments, signing, tensors, training, zoo
from muninn_worker.challenge import CheckpointStore
from muninn_worker.receipt import build_receipt
from muninn_worker.segments import Checkpoint
from rest_framework.test import APIClient
from sklearn.datasets import load_digits

from accounts import services as accounts
from accounts.models import User
from billing import money
from billing import selectors as ledger
from billing import services as billing
from billing.models import PayoutAccount
from contributors import services as contributors
from muninn.celery import app as celery_app


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """pytest-django's test database, and at the end no session left on it that would stop it being dropped: the
    real processes of the end-to-end tests keep their connections (the web server for CONN_MAX_AGE, Celery between
    tasks), and a backend outlives its killed process by a moment."""
    yield
    from django.db import connection

    if connection.vendor != "postgresql":
        return
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        for _ in range(50):
            cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                           "WHERE datname = current_database() AND pid <> pg_backend_pid()")
            if not cursor.fetchone()[0]:
                break
            time.sleep(0.1)
    connection.close()


@pytest.fixture(scope="session", autouse=True)
def _suite_password_hasher():
    """Users made in the tests' process hash their passwords at a cost the suite can afford (tests/hashers.py);
    the site's own hashers stay listed after it, so any hash verifies."""
    from django.conf import settings
    from django.test.utils import override_settings

    with override_settings(PASSWORD_HASHERS=["tests.hashers.SuitePBKDF2PasswordHasher", *settings.PASSWORD_HASHERS]):
        yield


@pytest.fixture(autouse=True)
def _isolated_media(settings, tmp_path):
    settings.MEDIA_ROOT = str(tmp_path / "media")


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Each test starts with empty rate-limit counters (muninn/throttles.py): tests must not throttle each other;
    and with empty per-process caches keyed by ids, which a test that resets the id sequences would otherwise
    find filled by an earlier test's rows of the same ids (jobs.selectors.round_fixed, contributors.results)."""
    from django.core.cache import cache

    from contributors import exposure, results
    from jobs import selectors as job_selectors

    cache.clear()
    exposure.policy_forget()  # the sensitive-data trust policy, read from a row each test makes afresh
    job_selectors._FIXED.clear()
    results._NORM_BOUNDS.clear()
    results._FIRST_COMMITMENTS.clear()


@pytest.fixture(autouse=True)
def _eager_celery():
    """In-process tests run tasks at once; the end-to-end tests switch this off and use a real worker."""
    celery_app.conf.task_always_eager = True
    yield
    celery_app.conf.task_always_eager = False


@pytest.fixture
def staff(db) -> User:
    return accounts.user_create(username="staff", password="staff-pass-123", role=User.Role.STAFF)


@pytest.fixture
def customer(db, staff) -> User:
    user = accounts.user_create(username="alice", password="alice-pass-123", role=User.Role.CUSTOMER)
    billing.balance_grant(user=user, amount=money.to_nanos("10"), reason="test credit", granted_by=staff)
    return user


@pytest.fixture
def contributor(db) -> User:
    return accounts.user_create(username="bob", password="bob-pass-123", role=User.Role.CONTRIBUTOR)


@pytest.fixture
def customer_api(customer) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {accounts.token_for(user=customer)}")
    return client


CAPABILITIES = {"cpu_cores": 2, "ram_bytes": 8 * 2**30, "backends": ["cpu"], "gpus": [], "torch_version": "2.13.0",
                "samples_per_s": 1000.0, "flops_per_s": 2e9}


class SimulatedDevice:
    """A contributor device driven through the worker API with real local training: it keeps a checkpoint at
    every segment boundary, commits to them in its receipt, and answers the site's challenges with them
    (`answer=False` leaves a challenge unanswered). `numerics="f64"` trains with another device's arithmetic."""

    def __init__(self, contributor: User, name: str, *, numerics: str = "native", answer: bool = True,
                 capabilities: dict | None = None):
        self.signing_key = signing.new_private_key()
        self.device, token = contributors.device_register(owner=contributor, name=name,
                                                          capabilities=capabilities or CAPABILITIES,
                                                          public_key=signing.public_key_of(self.signing_key))
        self.token = token
        self.client = APIClient()
        self.client.credentials(HTTP_AUTHORIZATION=f"Device {token}")
        self.numerics, self.answer = numerics, answer
        self.stores: dict[int, CheckpointStore] = {}
        self._root = tempfile.mkdtemp(prefix=f"muninn-{name}-")

    def claim(self) -> dict | None:
        """The next unit; peer checks the site hands out first are run on the way (see run_check)."""
        while True:
            response = self.client.post("/api/worker/claim", {}, format="json")
            assert response.status_code in (200, 204), response.content
            if response.status_code == 204:
                return None
            if "check" not in response.json():
                return response.json()["unit"]
            self.run_check(response.json()["check"])

    def run_check(self, check: dict, *, lie: bool = False):
        """A peer check: re-train another device's segment from its start checkpoint and report the end (`lie`:
        report it nudged off, as a dishonest peer would)."""
        get = lambda kind: b"".join(self.client.get(  # noqa: E731
            f"/api/worker/checks/{check['id']}/{kind}").streaming_content if kind != "start" else
            [self.client.get(f"/api/worker/checks/{check['id']}/start").content])
        start = segments.bytes_to_checkpoint(get("start"))
        assert tensors.sha256_hex(get("start")) == check["start_sha256"]
        xy = tensors.bytes_to_state_dict(get("shard"))
        model = zoo.build_model(check["template"], check["model_config"])
        end, _ = training.train_segment(model, xy["X"], xy["y"], start, first_step=check["first_step"],
                                        steps=check["steps"], numerics=self.numerics, **check["train"])
        if lie:
            end = Checkpoint({k: v * 1.01 if v.is_floating_point() else v for k, v in end.weights.items()},
                             end.optimizer)
        body = json.dumps({"check": check["id"], "end": end.commitment()})
        response = self.client.post(f"/api/worker/checks/{check['id']}/result",
                                    {"checkpoint": io.BytesIO(segments.checkpoint_to_bytes(end)), "receipt": body,
                                     "signature": signing.sign(self.signing_key, body.encode())}, format="multipart")
        assert response.status_code == 201, response.content
        return response.json()

    def train(self, unit: dict, *, data=None) -> tuple[bytes, dict]:
        """Train the unit as the reference client does; `data(X, y)` changes the shard first (a cheat that
        trains on other data, with a chain of checkpoints true to that training)."""
        weights = b"".join(self.client.get(f"/api/worker/units/{unit['id']}/weights").streaming_content)
        shard = b"".join(self.client.get(f"/api/worker/units/{unit['id']}/shard").streaming_content)
        model = zoo.build_model(unit["template"], unit["model_config"])
        model.load_state_dict(tensors.bytes_to_state_dict(weights))
        if unit.get("base_sha256"):
            base = b"".join(self.client.get(f"/api/worker/units/{unit['id']}/base").streaming_content)
            assert tensors.sha256_hex(base) == unit["base_sha256"]
            self.base_bytes_downloaded = getattr(self, "base_bytes_downloaded", 0) + len(base)
            zoo.load_base(model, tensors.bytes_to_state_dict(base))
        xy = tensors.bytes_to_state_dict(shard)
        if data is not None:
            xy["X"], xy["y"] = data(xy["X"], xy["y"])
        started = datetime.now(UTC)
        store = self.stores[unit["id"]] = CheckpointStore(self._root, unit["id"])
        train = {k: v for k, v in unit["train"].items() if k != "segment_steps"}
        result = training.train_local(model, xy["X"], xy["y"], **train, segment_steps=unit["train"]["segment_steps"],
                                      on_boundary=store.keep, numerics=self.numerics)
        glob = tensors.bytes_to_state_dict(weights)
        out = codec.encode_update(result.state_dict, glob, unit["encoding"])
        chain = store.seal(Checkpoint(result.state_dict, result.optimizer_state), glob, unit["encoding"])
        receipt = build_receipt({**unit, "weights_sha256": tensors.sha256_hex(weights),
                                 "shard_sha256": tensors.sha256_hex(shard)}, result,
                                output_sha256=tensors.sha256_hex(out), started_at=started.isoformat(),
                                finished_at=datetime.now(UTC).isoformat(),
                                segment_steps=unit["train"]["segment_steps"], checkpoints=[list(c) for c in chain])
        return out, receipt

    def global_state(self, unit: dict) -> dict:
        return tensors.bytes_to_state_dict(
            b"".join(self.client.get(f"/api/worker/units/{unit['id']}/weights").streaming_content))

    def upload_of(self, unit: dict, state: dict, receipt: dict) -> tuple[bytes, dict]:
        """`state` (a full state, e.g. trained and then changed) as the unit's encoded upload, with a receipt and
        a last checkpoint consistent with those bytes: how a careful cheating device would send it (so that
        only re-training a segment can tell)."""
        glob = self.global_state(unit)
        data = codec.encode_update(state, glob, unit["encoding"])
        store = self.stores[unit["id"]]
        last = len(receipt["checkpoints"]) - 1
        honest_last = segments.bytes_to_checkpoint(store.path(last).read_bytes())
        lie = Checkpoint(state, honest_last.optimizer)
        store.path(last).write_bytes(segments.checkpoint_to_bytes(lie))
        chain = [list(c) for c in receipt["checkpoints"]]
        chain[-1] = [segments.commitment(codec.roundtrip(state, glob, unit["encoding"]), {})[0], chain[-1][1]]
        return data, {**receipt, "output_sha256": tensors.sha256_hex(data), "checkpoints": chain}

    def decoded(self, unit: dict, data: bytes) -> dict:
        """The full state an upload stands for, as the site decodes it."""
        return codec.decode_update(data, self.global_state(unit), unit["encoding"])

    def submit(self, unit_id: int, weights: bytes, receipt: dict, *, signature: str | None = None,
               checkpoint: bytes | None = None):
        """Post the result (with `checkpoint`, the last one offered along, when given); when the site challenges
        it (and `answer`), upload the checkpoints it asks for."""
        body = json.dumps(receipt)
        signature = signing.sign(self.signing_key, body.encode()) if signature is None else signature
        form = {"weights": io.BytesIO(weights), "receipt": body, "signature": signature}
        if checkpoint is not None:
            form["checkpoint"] = io.BytesIO(checkpoint)
        response = self.client.post(f"/api/worker/units/{unit_id}/result", form, format="multipart")
        challenge = response.json().get("challenge") if response.status_code == 201 else None
        if challenge and self.answer:
            self.answer_challenge(challenge)
        return response

    def last_checkpoint(self, unit_id: int, receipt: dict) -> bytes:
        """The last checkpoint's file, as the reference client sends it along with a unit of one segment."""
        return self.stores[unit_id].path(len(receipt["checkpoints"]) - 1).read_bytes()

    def answer_challenge(self, challenge: dict) -> list:
        store = self.stores[challenge["unit"]]
        return [self.client.post(f"/api/worker/units/{challenge['unit']}/checkpoints/{b}",
                                 {"checkpoint": io.BytesIO(store.path(b).read_bytes())}, format="multipart")
                for b in challenge["missing"]]

    def work_one(self) -> bool:
        unit = self.claim()
        if unit is None:
            return False
        response = self.submit(unit["id"], *self.train(unit))
        assert response.status_code == 201, response.content
        return True


@pytest.fixture
def make_device(contributor):
    return lambda name="device", **options: SimulatedDevice(contributor, name, **options)


def register_device(contributor: User, name: str = "device"):
    """A registered device with a real key pair (for tests that call services directly)."""
    key = signing.new_private_key()
    return contributors.device_register(owner=contributor, name=name, capabilities=CAPABILITIES,
                                        public_key=signing.public_key_of(key))[0]


def digits_npz(n: int | None = None) -> bytes:
    digits = load_digits()
    buf = io.BytesIO()
    np.savez(buf, X=digits.data[:n].astype(np.float32), y=digits.target[:n].astype(np.int64))
    return buf.getvalue()


@pytest.fixture
def digits_dataset(customer_api) -> dict:
    response = customer_api.post("/api/datasets", {"file": _named(digits_npz(), "digits.npz")}, format="multipart")
    assert response.status_code == 201, response.content
    return response.json()


def _named(data: bytes, name: str) -> io.BytesIO:
    f = io.BytesIO(data)
    f.name = name
    return f


named_file = _named


# --- Stripe: the real library against a local fake of its HTTP API ------------------------------------

@pytest.fixture(scope="session")
def _fake_stripe_server():
    from .fake_stripe import start_fake_stripe

    fake, server = start_fake_stripe()
    yield fake
    server.shutdown()


@pytest.fixture
def fake_stripe(_fake_stripe_server, settings):
    """Stripe configured (keys, webhook secret) and pointed at the fake; its record cleared for each test."""
    from .fake_stripe import WEBHOOK_SECRET

    _fake_stripe_server.reset()
    settings.STRIPE_SECRET_KEY = _fake_stripe_server.secret_key
    settings.STRIPE_WEBHOOK_SECRET = WEBHOOK_SECRET
    settings.STRIPE_API_BASE = _fake_stripe_server.base_url
    return _fake_stripe_server


@pytest.fixture
def contributor_api(contributor) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {accounts.token_for(user=contributor)}")
    return client


def post_webhook(client, payload: dict | bytes, **sign) -> object:
    from .fake_stripe import signed

    body, header = signed(payload, **sign)
    return client.post("/api/stripe/webhook", data=body, content_type="application/json", HTTP_STRIPE_SIGNATURE=header)


# --- Earnings: a contributor paid for real verified work ---------------------------------------------

@pytest.fixture
def earned(settings, staff, customer, customer_api, make_device, contributor):
    """A contributor who did real verified work on a job priced high enough to earn tens of euros."""
    settings.MUNINN_PRICE_PER_HU = Decimal(10**11)
    billing.balance_grant(user=customer, amount=money.to_nanos("1000"), reason="test", granted_by=staff)
    device = make_device()
    dataset = customer_api.post("/api/datasets", {"file": _named(digits_npz(200), "digits.npz")}, format="multipart")
    job = customer_api.post("/api/jobs", {"dataset": dataset.json()["id"], "template": "mlp", "rounds": 1,
                                          "start": True}, format="json")
    assert job.status_code == 201, job.content
    while device.work_one():
        pass
    return contributor


def cleared(contributor) -> int:
    """Clear their pending earnings as if the holding period had passed; their available balance."""
    billing.earnings_clear(now=timezone.now() + timedelta(seconds=7 * 24 * 3600 + 1))
    return ledger.balances_for(user=contributor).get("contributor_available", 0)


@pytest.fixture
def ready(earned):
    PayoutAccount.objects.create(contributor=earned, stripe_account_id="acct_testready", payouts_enabled=True)
    cleared(earned)
    return earned


