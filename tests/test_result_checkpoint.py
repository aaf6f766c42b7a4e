"""The last checkpoint sent along with a result: a unit of one segment is checked without a second request."""
from __future__ import annotations

import pytest

from contributors.models import Device, Receipt

from .test_spine import create_job

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def one_segment(customer_api, digits_dataset, make_device):
    """A new device (every result checked) holding a unit of one segment: 1,438 samples in batches of 1,024 are
    2 steps an epoch, under the mlp's 8-step segments."""
    device = make_device(answer=False)  # it uploads nothing in answer to a challenge: only what the result carries
    create_job(customer_api, digits_dataset["id"], rounds=1, batch_size=1024)
    unit = device.claim()
    weights, receipt = device.train(unit)
    assert len(receipt["checkpoints"]) == 2, unit
    return device, unit, weights, receipt


def test_a_one_segment_result_with_its_last_checkpoint_is_checked_without_a_second_request(one_segment):
    device, unit, weights, receipt = one_segment

    response = device.submit(unit["id"], weights, receipt, checkpoint=device.last_checkpoint(unit["id"], receipt))

    # eager Celery: the validator re-trained the segment before the answer, which has nothing left to ask
    assert response.status_code == 201
    assert response.json()["status"] == "accepted" and response.json()["challenge"] is None
    stored = Receipt.objects.get(unit_id=unit["id"])
    assert stored.status == Receipt.Status.ACCEPTED and stored.verification["check"]["segments"] == [0]
    assert stored.verification["segment_check"]["passed"] and list(stored.checkpoint_blobs) == ["1"]


def test_without_the_checkpoint_the_challenge_asks_for_it(one_segment):
    device, unit, weights, receipt = one_segment

    response = device.submit(unit["id"], weights, receipt)

    assert response.status_code == 201 and response.json()["challenge"]["missing"] == [1]
    assert Receipt.objects.get(unit_id=unit["id"]).status == Receipt.Status.PENDING


def test_a_file_that_is_not_a_checkpoint_leaves_the_challenge_open(one_segment):
    device, unit, weights, receipt = one_segment

    response = device.submit(unit["id"], weights, receipt, checkpoint=b"not a checkpoint")

    assert response.status_code == 201 and response.json()["challenge"]["missing"] == [1]
    assert Receipt.objects.get(unit_id=unit["id"]).status == Receipt.Status.PENDING
    answered = device.answer_challenge(response.json()["challenge"])  # the device may still upload it
    assert [a.status_code for a in answered] == [200]
    assert Receipt.objects.get(unit_id=unit["id"]).status == Receipt.Status.ACCEPTED


def test_a_checkpoint_that_is_not_the_committed_one_fails_the_check(one_segment):
    device, unit, weights, receipt = one_segment
    other = device.stores[unit["id"]].path(0).read_bytes()  # a real checkpoint, but the start, not the end

    response = device.submit(unit["id"], weights, receipt, checkpoint=other)

    assert response.status_code == 201 and response.json()["status"] == "rejected"
    assert response.json()["reason"].startswith("checkpoint_mismatch: Checkpoint 1 is not the one")
    stored = Receipt.objects.get(unit_id=unit["id"])
    assert stored.status == Receipt.Status.REJECTED and stored.reason.startswith("checkpoint_mismatch")
    assert Device.objects.get(pk=device.device.pk).failures == 1
