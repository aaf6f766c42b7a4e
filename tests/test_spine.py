"""The life of a job through the real API and services, with devices simulated in-process (real training)."""
from __future__ import annotations

import pytest
from django.utils import timezone

from billing import selectors as ledger
from billing.models import Transaction
from contributors.models import Receipt
from jobs import services as jobs
from jobs import storage
from jobs.models import Job, Round, WorkUnit

from . import invariants

pytestmark = pytest.mark.django_db(transaction=True)


def create_job(api, dataset_id: int, *, rounds: int = 3, start: bool = True, aggregation: str = "fedavg",
               **hparams) -> dict:
    response = api.post("/api/jobs", {"dataset": dataset_id, "template": "mlp", "rounds": rounds, "seed": 3,
                                      "hparams": hparams, "start": start, "aggregation": aggregation},
                        format="json")
    assert response.status_code == 201, response.content
    return response.json()


def run_until_done(devices, job_id: int, max_steps: int = 200) -> Job:
    for _ in range(max_steps):
        job = Job.objects.get(pk=job_id)
        if job.is_ended:
            return job
        if not any(device.work_one() for device in devices):
            raise AssertionError(f"no work to do but job is {job.status} at round {job.current_round}")
    raise AssertionError("job did not finish")


def assert_ledger_consistent(job: Job) -> None:
    invariants.assert_ledger_invariants(job)


def test_job_trains_to_a_better_model_and_credits_contributors(customer_api, digits_dataset, make_device,
                                                               contributor):
    devices = [make_device("a"), make_device("b")]
    job = create_job(customer_api, digits_dataset["id"], rounds=4)

    done = run_until_done(devices, job["id"])

    assert done.status == Job.Status.SUCCEEDED
    rounds = list(done.round_set.order_by("number"))
    assert [r.number for r in rounds] == [1, 2, 3, 4]
    # two devices online → two shards in round 1 (neither measured yet: both count at the same speed); later
    # shards are sized by the speeds measured on real units, so a device the clock found far slower (a loaded
    # machine) may get none, and every round still trains on the whole training set
    assert rounds[0].metrics["units"] == 2 and all(r.metrics["units"] in (1, 2) for r in rounds)
    assert all(r.metrics["samples"] == done.n_train for r in rounds)
    assert rounds[-1].metrics["test_accuracy"] > rounds[0].metrics["test_accuracy"]
    assert rounds[-1].metrics["test_accuracy"] >= 0.85
    assert_ledger_consistent(done)
    money = ledger.job_money(job=done)
    assert money["flops_charged"] == done.flops_estimated  # every estimated FLOP was verified work
    assert money["quoted"] - 1 <= money["charged"] <= money["quoted"]  # the exact price, to the nano
    assert money["held"] == 0 and money["charged"] + money["released"] == money["quoted"]
    assert ledger.balances_for(user=contributor)["contributor_pending"] > 0

    model = customer_api.get(f"/api/jobs/{done.pk}/model")
    assert model.status_code == 200
    from muninn_worker import tensors

    assert set(tensors.bytes_to_state_dict(b"".join(model.streaming_content))) == set(
        tensors.bytes_to_state_dict(storage.blob_get(rounds[0].weights_sha256)))


def test_round_completes_with_one_device(customer_api, digits_dataset, make_device):
    device = make_device("alone")
    job = create_job(customer_api, digits_dataset["id"], rounds=2)

    done = run_until_done([device], job["id"])

    assert done.status == Job.Status.SUCCEEDED
    for rnd in done.round_set.all():
        assert rnd.units.count() == 1
        assert rnd.metrics["samples"] == done.n_train  # the lone device trained on the whole round
    assert_ledger_consistent(done)


def test_worker_killed_mid_unit_is_replaced_and_nothing_is_credited_twice(customer_api, digits_dataset,
                                                                          make_device):
    killed, survivor = make_device("killed"), make_device("survivor")
    job = create_job(customer_api, digits_dataset["id"], rounds=1)
    unit = killed.claim()
    weights, receipt = killed.train(unit)  # ... and then the process dies before uploading

    WorkUnit.objects.filter(pk=unit["id"]).update(lease_expires_at=timezone.now() - timezone.timedelta(seconds=1))
    assert jobs.units_requeue_expired() == 1
    done = run_until_done([survivor], job["id"])
    late = killed.submit(unit["id"], weights, receipt)  # the dead device's result arrives after all

    assert done.status == Job.Status.SUCCEEDED
    assert late.status_code == 409
    assert late.json()["error"]["code"] in ("lease_lost", "already_done")
    assert Receipt.objects.filter(unit_id=unit["id"], status=Receipt.Status.ACCEPTED).get().device == survivor.device
    assert Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit_id=unit["id"]).count() == 1
    assert_ledger_consistent(done)


def test_the_same_result_posted_twice_is_accepted_and_credited_once(customer_api, digits_dataset, make_device):
    device = make_device()
    create_job(customer_api, digits_dataset["id"], rounds=2)
    unit = device.claim()
    weights, receipt = device.train(unit)

    first = device.submit(unit["id"], weights, receipt)
    again = device.submit(unit["id"], weights, receipt)  # the client never saw the first answer and retried

    assert first.status_code == 201 and again.status_code == 201
    assert again.json()["unit"] == first.json()["unit"] and again.json()["status"] == "accepted"
    assert Receipt.objects.filter(unit_id=unit["id"]).count() == 1
    assert Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit_id=unit["id"]).count() == 1


def test_a_job_the_balance_cannot_cover_is_refused_and_nothing_changes(customer_api, digits_dataset, settings):
    settings.MUNINN_PRICE_PER_HU = 10**12  # make the job cost more than the customer's €10
    job = create_job(customer_api, digits_dataset["id"], rounds=2, start=False)
    before = list(Transaction.objects.values_list("id", flat=True))

    response = customer_api.post(f"/api/jobs/{job['id']}/start")

    assert response.status_code == 402
    assert response.json()["error"]["code"] == "insufficient_balance"
    assert "balance" in response.json()["error"]["message"]
    assert Job.objects.get(pk=job["id"]).status == Job.Status.CREATED
    assert list(Transaction.objects.values_list("id", flat=True)) == before
    assert not Round.objects.exists()


def test_cancelled_job_releases_the_rest_of_its_hold(customer_api, digits_dataset, make_device, customer):
    device = make_device()
    job = create_job(customer_api, digits_dataset["id"], rounds=5)
    device.work_one()
    balance_before_cancel = ledger.balances_for(user=customer)["customer_available"]

    response = customer_api.post(f"/api/jobs/{job['id']}/cancel")

    assert response.status_code == 200
    cancelled = Job.objects.get(pk=job["id"])
    assert cancelled.status == Job.Status.CANCELLED
    money = ledger.job_money(job=cancelled)
    assert money["held"] == 0 and money["charged"] + money["released"] == money["quoted"]
    assert ledger.balances_for(user=customer)["customer_available"] == balance_before_cancel + money["released"]
    assert device.claim() is None  # a cancelled job hands out no more work
    assert_ledger_consistent(cancelled)


def test_estimate_matches_the_job_and_the_price(customer_api, digits_dataset):
    choice = {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 3, "hparams": {"epochs": 1}}

    estimate = customer_api.post("/api/estimates", choice, format="json").json()
    job = customer_api.post("/api/jobs", choice, format="json").json()

    assert estimate["flops"] == job["flops_estimated"] > 0
    assert estimate["flops"] == 3 * estimate["flops_per_round"]
    assert estimate["price"]["nanos"] > 0 and estimate["price"]["currency"] == "EUR"
