"""A trusted device that turns to cheating cannot poison the model: every result has a segment re-trained before
it counts, however long the device's record (issue 18, item 1). Under a lowered check floor (an operator's
choice), the updates a device got accepted before it was caught are flagged on their jobs: left out of rounds
not combined yet, and named on the job page, in its API and in the model file where they are in the model."""
from __future__ import annotations

import json

import pytest
from django.test import Client
from muninn_worker import tensors

from contributors import credit, reputation
from contributors import services as contributors
from contributors.models import Device, Receipt
from jobs.models import Job, Round, WorkUnit

from .test_spine import assert_ledger_consistent, create_job

pytestmark = pytest.mark.django_db(transaction=True)

VETERAN_STREAK = 70  # verified results in a row: a 7 % check rate under the old 5 % floor


def a_tenth(X, y):
    """Train on the first tenth of the shard, tiled to its length: a tenth of the data's information for the
    same number of steps, which no cheap check can see (the loss on the shard still falls)."""
    tenth = max(1, len(y) // 10)
    tile = lambda t: t[:tenth].repeat(11, *[1] * (t.ndim - 1))[: len(y)]  # noqa: E731
    return tile(X), tile(y)


@pytest.fixture
def fast_requeue(settings):
    settings.MUNINN_UNIT_BACKOFF_SECONDS = settings.MUNINN_UNIT_BACKOFF_MAX_SECONDS = 0
    settings.MUNINN_RESERVATION_SECONDS = 0


def veteran(make_device, name="veteran"):
    device = make_device(name)
    Device.objects.filter(pk=device.device.pk).update(verified_streak=VETERAN_STREAK,
                                                      verified_total=VETERAN_STREAK, samples_per_s=1e6)
    return device


def test_a_veteran_that_turns_to_under_training_never_gets_an_update_into_a_model(
        customer_api, digits_dataset, make_device, fast_requeue):
    cheater, honest = veteran(make_device), make_device("honest")
    job = create_job(customer_api, digits_dataset["id"], rounds=4)
    quarantined = False

    for _ in range(200):
        if Job.objects.get(pk=job["id"]).is_ended:
            break
        if not quarantined:
            claim = cheater.client.post("/api/worker/claim", {}, format="json")
            quarantined = claim.status_code == 403
            if claim.status_code == 200 and "unit" in claim.json():
                unit = claim.json()["unit"]
                assert cheater.submit(unit["id"], *cheater.train(unit, data=a_tenth)).status_code == 201
        honest.work_one()
    done = Job.objects.get(pk=job["id"])

    assert done.status == Job.Status.SUCCEEDED
    receipts = Receipt.objects.filter(device=cheater.device)
    assert receipts.values("unit").distinct().count() == reputation.QUARANTINE_AFTER and quarantined  # then out
    assert all(r.verification["check"]["chosen"] and r.verification["check"]["rate"] == 1.0 for r in receipts)
    assert all(r.status == Receipt.Status.REJECTED and r.reason.startswith("reexecution_mismatch") for r in receipts)
    # every update combined into the model, round after round, is the honest device's, and each was checked
    combined = WorkUnit.objects.filter(round__job=done, status=WorkUnit.Status.ACCEPTED)
    assert combined.count() >= done.rounds
    assert set(Receipt.objects.filter(unit__in=combined, status=Receipt.Status.ACCEPTED)
               .values_list("device", flat=True)) == {honest.device.pk}
    assert all(r.verification["segment_check"]["passed"] for r in Receipt.objects.filter(device=honest.device))
    assert_ledger_consistent(done)


def test_under_a_lowered_floor_a_caught_veterans_earlier_updates_are_flagged_and_left_out_where_they_can_be(
        customer_api, digits_dataset, make_device, fast_requeue, settings, monkeypatch, customer, staff):
    settings.MUNINN_MIN_CHECK_RATE = reputation.ADAPTIVE_MIN_RATE
    drawn = {"check": False}  # the 7 % draw, decided by the test: unchecked until it is caught
    monkeypatch.setattr(reputation, "should_reexecute", lambda streak, draw, **floor: drawn["check"])
    # both rounds cut one shard per device: the speeds stay those of the probe, not the wall times measured on
    # a loaded machine (CI once measured the honest device 4 s slow, and round 2 went to the veteran alone)
    monkeypatch.setattr(credit, "_throughput", lambda current, *, measured, replace: current or measured)
    cheater, honest = veteran(make_device), make_device("honest")
    job = create_job(customer_api, digits_dataset["id"], rounds=2)

    # round 1: the veteran's under-trained update is accepted unchecked and combined into the model
    first = cheater.claim()
    assert cheater.submit(first["id"], *cheater.train(first, data=a_tenth)).status_code == 201
    assert honest.work_one()
    round_1 = Round.objects.get(job_id=job["id"], number=1)
    assert round_1.status == Round.Status.CLOSED and round_1.metrics["units"] == 2
    assert WorkUnit.objects.filter(round__job_id=job["id"], round__number=2).count() == 2
    # round 2: accepted unchecked again; before the honest device is done, the veteran is caught on other work
    second = cheater.claim()
    assert cheater.submit(second["id"], *cheater.train(second, data=a_tenth)).status_code == 201
    assert Receipt.objects.get(unit_id=second["id"]).status == Receipt.Status.ACCEPTED
    contributors.device_record_failure(device=cheater.device, reason="reexecution_mismatch: on another job")

    assert honest.work_one()  # round 2 closes without the flagged update, and the job ends
    done = Job.objects.get(pk=job["id"])
    assert done.status == Job.Status.SUCCEEDED
    round_2 = Round.objects.get(job=done, number=2)
    assert round_2.metrics["units"] == 1 and round_2.metrics["flagged_left_out"] == [second["id"]]
    honest_unit = WorkUnit.objects.get(round=round_2, receipts__device=honest.device)
    assert round_2.result_sha256 != round_2.weights_sha256
    expected = tensors.bytes_to_state_dict(_blob(honest_unit.result_sha256))
    assert all((tensors.bytes_to_state_dict(_blob(round_2.result_sha256))[k] == v).all() for k, v in expected.items())

    detail = customer_api.get(f"/api/jobs/{done.pk}").json()
    assert [(f["round"], f["unit"], f["in_model"]) for f in detail["flagged_updates"]] == [
        (1, first["id"], True), (2, second["id"], False)]
    assert all("accepted without a check" in f["reason"] for f in detail["flagged_updates"])
    page = Client()
    page.force_login(customer)
    html = page.get(f"/jobs/{done.pk}/").content.decode()
    assert "Updates in doubt" in html and "no (left out)" in html
    model = b"".join(customer_api.get(f"/api/jobs/{done.pk}/model").streaming_content)
    assert json.loads(_metadata(model)["muninn_flagged_rounds"]) == [1]

    # staff review the device, find it honest after all: the marks go
    contributors.device_release_held_earnings(device=cheater.device, staff=staff, reason="reviewed: honest")
    assert customer_api.get(f"/api/jobs/{done.pk}").json()["flagged_updates"] == []
    assert_ledger_consistent(done)


def _metadata(safetensors: bytes) -> dict:
    header = int.from_bytes(safetensors[:8], "little")
    return json.loads(safetensors[8:8 + header])["__metadata__"]


def _blob(sha: str) -> bytes:
    from jobs import storage

    return storage.blob_get(sha)
