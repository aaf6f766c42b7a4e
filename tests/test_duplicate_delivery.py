"""The same signed upload delivered twice at once (a client that timed out and sent it again while the site was
still checking the first): one receipt, one credit, the same answer to both, and nothing held against the device.
The round's lock is held while both are sent, so both meet in the database every time: one acceptance waits on the
other's (jobs.unit_accept_with)."""
from __future__ import annotations

import json
import threading

import pytest
from django.db import connection, transaction

from billing.models import Transaction
from contributors import results
from contributors.models import DeviceEvent, Receipt
from jobs import storage
from jobs.models import Round, WorkUnit
from muninn_worker import signing

from .test_round_concurrency import waiting_for_a_lock
from .test_spine import create_job

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def test_a_result_delivered_twice_at_once_gets_one_receipt_and_the_same_answer(
        customer_api, digits_dataset, make_device):
    if connection.vendor != "postgresql":
        pytest.fail("needs PostgreSQL (row locks between two requests): run it through `make test`")
    # answer=False: the simulated device answers a challenge by uploading its checkpoints as soon as it has the
    # answer, and the second delivery's answer, read after that, would list fewer of them as missing
    device = make_device(answer=False)
    create_job(customer_api, digits_dataset["id"], rounds=2)
    unit = device.claim()
    weights, receipt = device.train(unit)
    round_id = WorkUnit.objects.get(pk=unit["id"]).round_id
    answers, held, release = {}, threading.Event(), threading.Event()

    def hold_the_round() -> None:  # as an aggregation or another result of the round holds it
        try:
            with transaction.atomic():
                Round.objects.select_for_update().get(pk=round_id)
                held.set()
                release.wait(60)
        finally:
            connection.close()

    def deliver(key: str) -> None:
        try:
            answers[key] = device.submit(unit["id"], weights, receipt)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_the_round)
    holder.start()
    assert held.wait(30)
    deliveries = [threading.Thread(target=deliver, args=(key,)) for key in ("first", "again")]
    for thread in deliveries:
        thread.start()
    try:
        waiting_for_a_lock(2, timeout=60)  # both checked, and both acceptances waiting on the round
    finally:
        release.set()
        holder.join()
        for thread in deliveries:
            thread.join(timeout=60)

    assert answers["first"].status_code == 201, answers["first"].content
    assert answers["again"].status_code == 201, answers["again"].content
    assert answers["again"].json() == answers["first"].json()
    assert Receipt.objects.filter(unit_id=unit["id"]).count() == 1
    assert Round.objects.get(pk=round_id).arrivals == 1
    assert Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit_id=unit["id"]).count() <= 1
    assert not DeviceEvent.objects.filter(device=device.device).exists()


def test_a_live_result_of_the_same_unit_is_not_a_replay(customer_api, digits_dataset, make_device):
    """The replay rule refuses a device's earlier weights sent for another unit; the same unit's live receipt is
    this very upload again, which must never count as a failure."""
    device = make_device()
    create_job(customer_api, digits_dataset["id"], rounds=2)
    unit = device.claim()
    weights, receipt = device.train(unit)
    assert device.submit(unit["id"], weights, receipt).status_code == 201
    stored = Receipt.objects.get(unit_id=unit["id"])

    body = json.dumps(receipt).encode()
    evidence, _, _, _ = results._check(device=device.device, unit=stored.unit, lease=stored.lease, weights=weights,
                                    output_sha=stored.output_sha256,
                                    reference_bytes=storage.blob_get(stored.unit.round.weights_sha256),
                                    receipt=receipt, receipt_bytes=body,
                                    signature=signing.sign(device.signing_key, body))

    assert "same_bytes_as_receipt" not in evidence


def test_the_same_work_in_a_job_run_again_is_no_replay(customer_api, digits_dataset, make_device):
    """A customer runs the same job twice (same data, seed and settings): the two jobs' units are the same work,
    and an honest device that trains both sends the same bytes twice. That is its honest answer, not a replay."""
    device = make_device()
    first = create_job(customer_api, digits_dataset["id"], rounds=1)
    unit_a = device.claim()
    upload = device.train(unit_a)
    assert device.submit(unit_a["id"], *upload).status_code == 201
    create_job(customer_api, digits_dataset["id"], rounds=1)  # the same job again
    unit_b = device.claim()
    assert unit_b["job"] != first["id"] and unit_b["shard_sha256"] == unit_a["shard_sha256"]

    again = device.train(unit_b)

    assert again[0] == upload[0]  # the very same bytes
    answer = device.submit(unit_b["id"], *again)
    assert answer.status_code == 201, answer.content
    assert not DeviceEvent.objects.filter(device=device.device, kind=DeviceEvent.Kind.FAILURE).exists()
