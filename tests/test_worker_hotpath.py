"""Claims and heartbeats are answered ahead of Django's full request path (contributors/hotpath.py): the same
answers as the API views give, every refusal included, in fewer statements."""
from __future__ import annotations

import io
import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from muninn_worker import signing
from rest_framework.test import APIClient

from accounts.models import User
from contributors import api, services
from contributors.models import Device
from jobs.models import WorkUnit

from .test_spine import create_job

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]
HOT = "contributors.hotpath.WorkerHotPathMiddleware"


def _client(token: str, **headers) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Device {token}", **headers)
    return client


def _answer(response) -> tuple:
    body = response.json() if response.content else None
    if isinstance(body, dict) and "unit" in body and isinstance(body["unit"], dict):
        body["unit"].pop("lease_expires_at")  # the lease's time, a moment apart
    if isinstance(body, dict) and "lease_expires_at" in body:
        body.pop("lease_expires_at")
    return response.status_code, body, response.get("Retry-After"), response.get("Content-Type")


def _requests(token: str, other_token: str, unit_id: int) -> list:
    """Every kind of claim and heartbeat a client may send, each as (client, method args)."""
    mine, theirs, old = _client(token), _client(other_token), _client(token, HTTP_USER_AGENT="muninn-worker/0.0.1")
    stranger, malformed = _client("not-a-token"), APIClient()
    malformed.credentials(HTTP_AUTHORIZATION="Device")
    return [
        (mine, f"/api/worker/units/{unit_id}/heartbeat", None, None),
        (theirs, f"/api/worker/units/{unit_id}/heartbeat", None, None),  # not the holder: lease_lost
        (mine, "/api/worker/units/999999999/heartbeat", None, None),  # no such unit
        (mine, "/api/worker/units/99999999999999999999/heartbeat", None, None),  # no such URL
        (stranger, f"/api/worker/units/{unit_id}/heartbeat", None, None),
        (malformed, f"/api/worker/units/{unit_id}/heartbeat", None, None),
        (old, f"/api/worker/units/{unit_id}/heartbeat", None, None),  # too old a client: 426
        (theirs, "/api/worker/claim", {"wait": "soon"}, "json"),
        (theirs, "/api/worker/claim", {"wait": -1}, "json"),
        (theirs, "/api/worker/claim", {"backends": ["cuda"]}, "json"),
        (theirs, "/api/worker/claim", {"backends": "tpu"}, "json"),
        (theirs, "/api/worker/claim", "[1, 2]", "application/json"),
        (theirs, "/api/worker/claim", "{not json", "application/json"),
        (theirs, "/api/worker/claim", "wait=0", "application/x-www-form-urlencoded"),
        (stranger, "/api/worker/claim", {}, "json"),
        (old, "/api/worker/claim", {}, "json"),
        (theirs, "/api/worker/claim?wait=x", None, None),
    ]


def _send(client, path, body, kind):
    if kind in ("json", "multipart"):
        return client.post(path, body, format=kind)
    if kind:
        return client.post(path, body, content_type=kind)
    return client.post(path)


def test_the_hot_path_answers_every_claim_and_heartbeat_as_the_views_do(customer_api, digits_dataset, make_device,
                                                                          settings):
    a, b = make_device("a"), make_device("b")
    hot = _client(a.token)
    assert hot.post("/api/worker/claim", {}, format="json").status_code == 204  # no work yet (loads the hot chain)
    create_job(customer_api, digits_dataset["id"], rounds=1)
    b.claim()  # b holds its own unit: its claims below find nothing or are refused
    claimed = hot.post("/api/worker/claim", {}, format="json")
    unit_id = claimed.json()["unit"]["id"]
    hot_answers = [_answer(_send(*request)) for request in _requests(a.token, b.token, unit_id)]
    assert a.client.post(f"/api/worker/units/{unit_id}/release").status_code == 200

    settings.MIDDLEWARE = [m for m in settings.MIDDLEWARE if m != HOT]  # clients made from here on: the full way
    again = _client(a.token).post("/api/worker/claim", {}, format="json")
    full_answers = [_answer(_send(*request)) for request in _requests(a.token, b.token, unit_id)]

    assert again.json()["unit"]["id"] == unit_id  # given back: queued again at once, for the same device
    assert _answer(claimed) == _answer(again)
    assert hot_answers == full_answers
    statuses = [answer[0] for answer in hot_answers]
    assert statuses == [200, 409, 404, 404, 401, 401, 426, 400, 400, 400, 400, 400, 400, 204, 401, 426, 400]


def test_a_holders_heartbeat_is_one_statement_that_extends_the_lease_and_marks_the_device_seen(
        customer_api, digits_dataset, make_device):
    device = make_device("d")
    create_job(customer_api, digits_dataset["id"], rounds=1)
    unit = device.claim()
    device.client.post(f"/api/worker/units/{unit['id']}/heartbeat")  # the first: the token's device id is looked up
    Device.objects.filter(pk=device.device.pk).update(last_seen_at=None)

    with CaptureQueriesContext(connection) as queries:
        answer = device.client.post(f"/api/worker/units/{unit['id']}/heartbeat")

    assert answer.status_code == 200, answer.content
    # One statement on PostgreSQL (hotpath: its CTEs); elsewhere the full way's authentication, touch and update.
    assert len(queries) == (1 if connection.vendor == "postgresql" else 3)
    leased = WorkUnit.objects.get(pk=unit["id"])
    assert leased.lease_expires_at.isoformat().replace("+00:00", "Z") == answer.json()["lease_expires_at"]
    assert Device.objects.get(pk=device.device.pk).last_seen_at is not None


def test_a_device_disabled_after_its_heartbeats_were_served_is_refused(customer_api, digits_dataset, make_device):
    device = make_device("d")
    create_job(customer_api, digits_dataset["id"], rounds=1)
    unit = device.claim()
    beat = f"/api/worker/units/{unit['id']}/heartbeat"
    assert device.client.post(beat).status_code == 200  # its id is known to this process now

    Device.objects.filter(pk=device.device.pk).update(is_active=False)
    assert device.client.post(beat).status_code == 401
    Device.objects.filter(pk=device.device.pk).update(is_active=True)
    User.objects.filter(pk=device.device.owner_id).update(is_active=False)
    assert device.client.post(beat).status_code == 401
    assert device.client.post("/api/worker/claim", {}, format="json").status_code == 401


def test_the_two_paths_share_one_rate_limit(customer_api, digits_dataset, make_device, settings):
    settings.MUNINN_THROTTLES = {**settings.MUNINN_THROTTLES, "heartbeat": "3/min", "claim": "2/min"}
    device, other = make_device("d"), make_device("o")
    create_job(customer_api, digits_dataset["id"], rounds=1)
    unit = device.claim()  # claim 1 of 2
    beat = f"/api/worker/units/{unit['id']}/heartbeat"

    # a heartbeat the hot path serves, one it hands on (another device's unit), and one it serves again
    assert device.client.post(beat).status_code == 200
    assert other.client.post(beat).status_code == 409
    assert [device.client.post(beat).status_code for _ in range(3)] == [200, 200, 429]
    refused = device.client.post(beat)
    assert refused.status_code == 429 and int(refused["Retry-After"]) > 0
    assert refused.json()["error"]["code"] == "throttled"
    assert device.client.post("/api/worker/claim", {}, format="json").status_code == 204  # claim 2 of 2
    assert device.client.post("/api/worker/claim", {}, format="json").status_code == 429


def test_a_quarantined_device_is_refused_its_claims_the_same_either_way(customer_api, digits_dataset, make_device,
                                                                        settings):
    device = make_device("d")
    create_job(customer_api, digits_dataset["id"], rounds=1)
    Device.objects.filter(pk=device.device.pk).update(quarantined_at="2026-01-01T00:00:00Z",
                                                      quarantine_reason="a test")

    hot = _answer(device.client.post("/api/worker/claim", {}, format="json"))
    settings.MIDDLEWARE = [m for m in settings.MIDDLEWARE if m != HOT]
    full = _answer(_client(device.token).post("/api/worker/claim", {}, format="json"))

    assert hot == full
    assert hot[0] == 403 and hot[1]["error"]["code"] == "device_quarantined"


def _result_requests(device, unit_id: int, stranger_token: str, theirs: int) -> list:
    """Results the hot path must answer as ResultView does: each refused before its checks (the unit stays leased),
    and forms it leaves to the full way. Each is (client, path, data, format or content type)."""
    weights, receipt = device.train({"id": unit_id, **device.units[unit_id]})
    text = json.dumps(receipt)
    signature = signing.sign(device.signing_key, text.encode())
    mine, stranger = _client(device.token), _client(stranger_token)
    old = _client(device.token, HTTP_USER_AGENT="muninn-worker/0.0.1")
    path, other = f"/api/worker/units/{unit_id}/result", "/api/worker/units/999999999/result"

    def form(**parts):
        return {"weights": io.BytesIO(weights), "receipt": text, "signature": signature, **parts}

    nameless = (f'--B\r\nContent-Disposition: form-data; name="weights"; filename=""\r\n\r\n').encode() + weights + \
        (f'\r\n--B\r\nContent-Disposition: form-data; name="receipt"\r\n\r\n{text}\r\n--B--\r\n').encode()
    return [
        (mine, path, {"receipt": text, "signature": signature}, "multipart"),  # no weights
        (mine, path, form(receipt="{not json"), "multipart"),
        (mine, path, form(receipt=json.dumps({**receipt, "samples": -1})), "multipart"),
        (mine, path, form(receipt=json.dumps({k: v for k, v in receipt.items() if k != "steps"})), "multipart"),
        (mine, path, form(receipt=io.BytesIO(text.encode())), "multipart"),  # the receipt as a file
        (mine, path, nameless, "multipart/form-data; boundary=B"),  # a file without a name: Django drops it
        (mine, path, receipt, "json"),  # not a form
        (mine, other, form(), "multipart"),  # no such unit
        (mine, f"/api/worker/units/{theirs}/result", form(), "multipart"),  # another device's: lease_lost
        (stranger, path, form(), "multipart"),
        (old, path, form(), "multipart"),
    ]


def test_the_hot_path_answers_every_result_as_the_view_does(customer_api, digits_dataset, make_device, settings,
                                                            monkeypatch):
    device, other = make_device("d"), make_device("o")
    create_job(customer_api, digits_dataset["id"], rounds=1)
    unit = device.claim()
    device.units = {unit["id"]: unit}
    theirs = other.claim()
    hot = [_answer(_send(*request)) for request in _result_requests(device, unit["id"], "not-a-token", theirs["id"])]
    # A good result, answered with ResultView out of the way: the hot path serves it.
    form = _signed_form(device, unit)
    monkeypatch.setattr(api.ResultView, "post", lambda *args, **kwargs: pytest.fail("the full way was taken"))
    # and the device's lease on the unit came with its authentication, in the same statement
    monkeypatch.setattr(services, "leased_unit", lambda **kwargs: pytest.fail("the lease was looked up again"))
    accepted = _client(device.token).post(f"/api/worker/units/{unit['id']}/result", form, format="multipart")
    monkeypatch.undo()

    settings.MIDDLEWARE = [m for m in settings.MIDDLEWARE if m != HOT]
    full = [_answer(_send(*request)) for request in _result_requests(device, unit["id"], "not-a-token", theirs["id"])]
    full_accepted = _client(other.token).post(f"/api/worker/units/{theirs['id']}/result",
                                              _signed_form(other, theirs), format="multipart")

    assert hot == full
    assert [answer[0] for answer in hot] == [400, 400, 400, 400, 400, 400, 415, 404, 409, 401, 426], hot
    assert hot[8][1]["error"]["code"] == "lease_lost"
    assert accepted.status_code == full_accepted.status_code == 201, (accepted.content, full_accepted.content)
    mine, theirs_answer = accepted.json(), full_accepted.json()
    assert mine.keys() == theirs_answer.keys() and mine["unit"] == unit["id"]
    assert (mine["status"], mine["credit"] if "credit" in mine else None) == \
        (theirs_answer["status"], theirs_answer.get("credit"))


def _signed_form(device, unit: dict) -> dict:
    weights, receipt = device.train(unit)
    text = json.dumps(receipt)
    return {"weights": io.BytesIO(weights), "receipt": text,
            "signature": signing.sign(device.signing_key, text.encode())}


def test_a_plainly_valid_receipt_is_validated_to_exactly_what_the_serializer_gives():
    """api._plainly_valid skips the serializer's machinery for the receipts honest clients send; whatever it accepts
    must validate to the very values the serializer gives (anything else is left to the serializer)."""
    import math
    import random

    from rest_framework import serializers

    rng = random.Random(5)
    serializer = api.ReceiptSerializer()
    hexes = lambda: f"{rng.getrandbits(256):064x}"  # noqa: E731
    odd = [None, True, False, 0, -1, 1, 2**31, 2**63, 1.0, 2.5, -0.0, float("nan"), float("inf"), "1", " 1", "",
           "2026-11-27T07:00:00Z", "2026-11-27T07:00:00+02:00", "2026-11-27", "yesterday", hexes().upper(),
           " " + hexes(), hexes() + "\n", [], [hexes(), hexes()], [[hexes(), hexes()]] * 3, {}, 1e31, -1e30]
    used = 0
    for _ in range(400):
        receipt = {"unit": rng.randint(1, 10**6), "weights_sha256": hexes(), "shard_sha256": hexes(),
                   "output_sha256": hexes(), "samples": rng.randint(1, 10**4), "steps": rng.randint(0, 10**4),
                   "loss_before": rng.choice([None, rng.uniform(0, 5), rng.randint(0, 5)]),
                   "loss_after": rng.choice([None, rng.uniform(0, 5)]),
                   "started_at": rng.choice(["2026-11-27T07:00:00Z", "2026-11-27T07:00:00.123456+00:00",
                                             "2026-11-27T09:00:00+02:00"]),
                   "finished_at": "2026-11-27T07:00:01.5Z", "train_seconds": rng.choice([0, 1.5, 3]),
                   "segment_steps": rng.randint(1, 50),
                   "checkpoints": [[hexes(), hexes()] for _ in range(rng.randint(2, 5))]}
        mutated = dict(receipt)
        if rng.random() < 0.8:
            field = rng.choice(list(receipt))
            if rng.random() < 0.1:
                del mutated[field]
            else:
                mutated[field] = rng.choice(odd)
        fast = api._plainly_valid(mutated, serializer)
        try:
            slow = serializer.run_validation(mutated)
        except serializers.ValidationError:
            slow = None
        if mutated == receipt:
            assert fast is not None, receipt  # the common case takes the fast way
        if fast is not None:
            used += 1
            assert fast == slow, mutated
            assert all(type(fast[k]) is type(slow[k]) for k in slow), mutated
            assert not any(isinstance(v, float) and math.isnan(v) for v in fast.values())
    assert used > 100


def test_the_norm_history_is_the_jobs_latest_accepted_units_across_its_rounds(customer_api, digits_dataset,
                                                                              make_device):
    """contributors.results' norm history reads a job's rounds from the latest (one index walk each): the same norms
    as the job's accepted units by id, newest first, whatever other jobs hold."""
    from django.db import connection as db
    from muninn import sql

    from contributors import results
    from jobs.models import Job, Round

    make_device("d")
    mine, other = (create_job(customer_api, digits_dataset["id"], rounds=5)["id"] for _ in range(2))
    template = WorkUnit.objects.filter(round__job_id=mine).first()
    copied = {f.attname: getattr(template, f.attname) for f in WorkUnit._meta.concrete_fields
              if f.attname not in ("id", "round_id", "index", "status", "result_metrics")}
    for job_id in (mine, other):
        first = Round.objects.get(job_id=job_id, number=1)
        rounds = [first] + [Round.objects.create(job_id=job_id, number=n, weights_sha256=first.weights_sha256,
                                                 deadline_at=first.deadline_at) for n in (2, 3, 4)]
        for rnd in rounds:  # interleaved with the other job's, a few left unaccepted
            for index in range(1, 90):
                WorkUnit.objects.create(
                    **copied, round=rnd, index=index,
                    status=WorkUnit.Status.ACCEPTED if index % 7 else WorkUnit.Status.QUEUED,
                    result_metrics={"update_norm_per_step": float(rnd.number * 1000 + index + job_id / 10)})
    expected = [u.result_metrics.get("update_norm_per_step") for u in WorkUnit.objects.filter(
        round__job_id=mine, status=WorkUnit.Status.ACCEPTED).order_by("-id")[:results.NORM_HISTORY_UNITS]]

    read = [float(norm) if norm is not None else None
            for norm, in sql.fetch_all(results._norms_sql(db.vendor), results._norms_params(db.vendor, mine))]

    assert len(expected) == results.NORM_HISTORY_UNITS and read == expected
    assert Job.objects.count() == 2
