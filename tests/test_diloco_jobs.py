"""DiLoCo jobs and encoded updates through the site: settings, quotes, the outer step and its momentum, and
a whole int8 job with devices simulated in-process (real training, real API)."""
from __future__ import annotations

import pytest
import torch
from muninn_worker import codec, tensors
from muninn_worker.federated import algorithms, robust
from muninn_worker.federated.aggregation import diloco_outer_step

from billing import selectors as ledger
from billing.models import Quote
from contributors.models import Receipt
from jobs import storage
from jobs import services as jobs
from jobs.models import Job, Round, WorkUnit

from .test_spine import assert_ledger_consistent, run_until_done

pytestmark = pytest.mark.django_db(transaction=True)


def diloco_job(api, dataset_id: int, *, rounds: int = 3, **choice) -> dict:
    body = {"dataset": dataset_id, "template": "mlp", "rounds": rounds, "seed": 3, "start": True,
            "algorithm": "diloco", **choice}
    response = api.post("/api/jobs", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def state_of(sha: str) -> dict:
    return tensors.bytes_to_state_dict(storage.blob_get(sha))


# --- Settings ---------------------------------------------------------------------------------------

def test_diloco_settings_default_to_the_papers_outer_step():
    chosen = algorithms.scheme(algorithm="diloco")
    assert (chosen.outer_lr, chosen.outer_momentum, chosen.inner_steps, chosen.update_encoding) == (
        0.7, 0.9, algorithms.DEFAULT_INNER_STEPS, "fp32")
    assert algorithms.scheme() == algorithms.Scheme("fedavg", None, None, None, "fp32")


@pytest.mark.parametrize("choice, field", [
    ({"algorithm": "diloco", "outer_lr": 0}, "outer_lr"),
    ({"algorithm": "diloco", "outer_lr": 11}, "outer_lr"),
    ({"algorithm": "diloco", "outer_momentum": 1.0}, "outer_momentum"),
    ({"algorithm": "diloco", "outer_momentum": -0.1}, "outer_momentum"),
    ({"algorithm": "diloco", "inner_steps": 0}, "inner_steps"),
    ({"algorithm": "diloco", "inner_steps": 10_001}, "inner_steps"),
    ({"algorithm": "fedavg", "inner_steps": 5}, "inner_steps"),  # a DiLoCo setting on a FedAvg job does nothing
    ({"algorithm": "fedavg", "outer_lr": 0.5}, "outer_lr"),
])
def test_bad_algorithm_settings_are_refused_naming_the_field_and_nothing_is_created(customer_api, digits_dataset,
                                                                                   choice, field):
    body = {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 2, "start": True, **choice}

    responses = [customer_api.post(path, body, format="json") for path in ("/api/jobs", "/api/quotes",
                                                                           "/api/estimates")]

    for response in responses:
        assert response.status_code == 400, response.content
        assert response.json()["error"]["code"] == "bad_algorithm"
        assert response.json()["error"]["detail"]["field"] == field
    assert not Job.objects.exists() and not Quote.objects.exists()


@pytest.mark.parametrize("field, value", [("algorithm", "sgd"), ("update_encoding", "int4")])
def test_unknown_algorithm_or_encoding_is_a_400(customer_api, digits_dataset, field, value):
    response = customer_api.post("/api/jobs", {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 2,
                                               field: value}, format="json")
    assert response.status_code == 400 and field in str(response.json()["error"])
    assert not Job.objects.exists()


def test_quote_keeps_the_algorithm_and_the_job_is_created_with_it(customer_api, digits_dataset):
    chosen = {"algorithm": "diloco", "outer_lr": 0.5, "outer_momentum": 0.8, "inner_steps": 12,
              "update_encoding": "int8"}
    quote = customer_api.post("/api/quotes", {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 2,
                                              **chosen}, format="json").json()

    accepted = customer_api.post(f"/api/quotes/{quote['id']}/accept")

    assert accepted.status_code == 201, accepted.content
    job = Job.objects.get(pk=accepted.json()["id"])
    assert {k: quote[k] for k in chosen} == chosen
    assert jobs.job_scheme(job).fields() == chosen and job.flops_estimated == quote["flops"]


def test_a_fedavg_quote_cannot_start_a_diloco_job(customer_api, digits_dataset):
    quote = customer_api.post("/api/quotes", {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 2},
                              format="json").json()
    job = customer_api.post("/api/jobs", {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 2,
                                          "algorithm": "diloco"}, format="json").json()
    Quote.objects.filter(pk=quote["id"]).update(flops=job["flops_estimated"])  # same price: only the algorithm differs

    response = customer_api.post(f"/api/jobs/{job['id']}/start", {"quote": quote["id"]}, format="json")

    assert response.status_code == 400 and response.json()["error"]["code"] == "quote_mismatch"
    assert Job.objects.get(pk=job["id"]).status == Job.Status.CREATED


def test_diloco_estimate_pays_inner_steps_of_one_batch_for_the_most_units_a_round_can_have(customer_api,
                                                                                            digits_dataset):
    job = Job.objects.get(pk=diloco_job(customer_api, digits_dataset["id"], rounds=2, inner_steps=7,
                                        start=False)["id"])
    batch = job.hparams["batch_size"]

    units = algorithms.max_units_per_round(job.n_train, batch)

    assert units == job.n_train // batch
    per_round = units * 7 * batch * job.flops_per_sample + 2 * job.n_train * job.forward_flops_per_sample
    assert job.flops_estimated == 2 * per_round
    # whatever the shard, a unit is 7 steps of one batch (and the receipt's two passes over its own shard)
    assert jobs.unit_flops(job, 500) == 7 * batch * job.flops_per_sample + 2 * 500 * job.forward_flops_per_sample


def test_diloco_quote_expects_the_time_of_the_devices_online_not_of_the_most_units(customer_api, digits_dataset,
                                                                                  make_device, settings):
    make_device("a"), make_device("b")  # 2 GFLOP/s each

    quote = customer_api.post("/api/quotes", {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 2,
                                              "algorithm": "diloco", "inner_steps": 10,
                                              "hparams": {"batch_size": 32}}, format="json").json()

    # two units of 10 steps × 32 samples per round (not the most a round could have), side by side on 4 GFLOP/s
    from jobs.models import Dataset
    est = jobs.job_plan(dataset=Dataset.objects.get(pk=digits_dataset["id"]), template="mlp", rounds=2,
                        hparams={"batch_size": 32}, training={"algorithm": "diloco", "inner_steps": 10}).estimate
    assert est.units_per_round > 2
    unit_flops = est.flops_per_round // est.units_per_round
    assert quote["expected_seconds"] == pytest.approx(
        2 * (2 * unit_flops / 4e9 + settings.MUNINN_ROUND_OVERHEAD_SECONDS))


# --- The outer step on the site ------------------------------------------------------------------------

def test_diloco_rounds_take_the_outer_step_and_carry_the_momentum(customer_api, digits_dataset, make_device):
    devices = [make_device("a"), make_device("b")]
    created = diloco_job(customer_api, digits_dataset["id"], rounds=2, inner_steps=5, outer_lr=0.6,
                         outer_momentum=0.8)

    done = run_until_done(devices, created["id"])

    assert done.status == Job.Status.SUCCEEDED
    first, second = done.round_set.order_by("number")
    momentum = None
    for rnd in (first, second):
        units = list(rnd.units.filter(status=WorkUnit.Status.ACCEPTED).order_by("index"))
        assert units  # one or two: the shards follow the devices' measured speeds
        average = robust.aggregate("fedavg", [state_of(u.result_sha256) for u in units],
                                   [u.result_samples for u in units], state_of(rnd.weights_sha256))
        expected, momentum = diloco_outer_step(state_of(rnd.weights_sha256), average, momentum, lr=0.6, beta=0.8)
        result = state_of(rnd.result_sha256)
        assert all(torch.allclose(result[k], v, atol=1e-6) for k, v in expected.items())
    assert second.weights_sha256 == first.result_sha256
    stored = state_of(done.outer_momentum_sha256)  # the buffers after round 2, built on round 1's
    assert all(torch.allclose(stored[k], v, atol=1e-6) for k, v in momentum.items())
    assert any(not torch.allclose(stored[k], v) for k, v in diloco_outer_step(
        state_of(second.weights_sha256), average, None)[1].items())  # i.e. not a fresh start in round 2


def test_aggregating_a_closed_diloco_round_again_changes_nothing(customer_api, digits_dataset, make_device):
    device = make_device()
    created = diloco_job(customer_api, digits_dataset["id"], rounds=3, inner_steps=3)
    assert device.work_one() and device.work_one()  # rounds 1 and 2 closed, round 3 open
    job = Job.objects.get(pk=created["id"])
    before = (job.global_weights_sha256, job.outer_momentum_sha256, job.current_round)
    closed = Round.objects.get(job=job, number=2)

    again = jobs.round_aggregate(round_id=closed.pk)

    job.refresh_from_db()
    assert again.status == Round.Status.CLOSED and again.result_sha256 == closed.result_sha256
    assert (job.global_weights_sha256, job.outer_momentum_sha256, job.current_round) == before


# --- A whole job -----------------------------------------------------------------------------------

def test_diloco_int8_job_learns_and_charges_what_was_done_within_the_quote(customer_api, digits_dataset,
                                                                          make_device):
    devices = [make_device("a"), make_device("b")]
    created = diloco_job(customer_api, digits_dataset["id"], rounds=4, inner_steps=15, update_encoding="int8")

    done = run_until_done(devices, created["id"])

    assert done.status == Job.Status.SUCCEEDED and done.update_encoding == "int8"
    rounds = list(done.round_set.order_by("number"))
    assert rounds[0].metrics["units"] == 2  # later rounds follow the measured speeds: one or two shards
    assert rounds[-1].metrics["test_loss"] < rounds[0].metrics["test_loss"]
    assert rounds[-1].metrics["test_accuracy"] >= 0.85
    receipts = Receipt.objects.filter(unit__round__job=done, status=Receipt.Status.ACCEPTED)
    assert {r.steps for r in receipts} == {15}  # the inner steps, not epochs
    # every upload was an int8 delta, decoded by the site before its checks and stored as the full state
    for receipt in receipts:
        encoded = codec.unpack(storage.blob_get(receipt.output_sha256))
        assert any(t.dtype == torch.int8 for t in encoded.values())
        assert receipt.unit.result_sha256 != receipt.output_sha256
        assert set(state_of(receipt.unit.result_sha256)) == set(state_of(rounds[0].weights_sha256))
    # new devices are checked: a segment re-trained from their own checkpoint agrees exactly (the last one's end
    # is the weights before encoding, which the site checked encode to exactly the int8 upload)
    checked = [r for r in receipts if r.verification["check"]["chosen"]]
    assert checked and all(s["distance"] == 0 for r in checked for s in r.verification["segment_check"]["segments"])
    assert_ledger_consistent(done)
    money = ledger.job_money(job=done)
    accepted = WorkUnit.objects.filter(round__job=done, status=WorkUnit.Status.ACCEPTED)
    assert money["flops_charged"] == sum(jobs.unit_flops(done, u.samples) for u in accepted)
    assert money["flops_charged"] <= done.flops_estimated
    assert money["held"] == 0 and money["charged"] + money["released"] == money["quoted"]
