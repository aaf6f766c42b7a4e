"""Verification in-process: re-execution, reputation, quarantine, robust aggregation per job."""
from __future__ import annotations

import pytest
from muninn_worker import tensors

from billing import selectors as ledger
from billing.models import Transaction
from contributors import services as contributors
from contributors.models import Device, DeviceEvent, Receipt
from contributors.selectors import receipt_was_checked
from jobs import services as jobs_services
from jobs.models import Job, WorkUnit

from .test_spine import assert_ledger_consistent, create_job, run_until_done

pytestmark = pytest.mark.django_db(transaction=True)


def cheat(device, unit: dict, change) -> object:
    """Train honestly, then change the weights, and submit them (encoded as the job says) with a self-consistent
    signed receipt."""
    weights, receipt = device.train(unit)
    state = device.decoded(unit, weights)
    change(state)
    return device.submit(unit["id"], *device.upload_of(unit, state, receipt))


def test_new_devices_work_is_reexecuted_and_only_then_credited(customer_api, digits_dataset, make_device):
    device = make_device()
    create_job(customer_api, digits_dataset["id"], rounds=1)

    unit = device.claim()
    response = device.submit(unit["id"], *device.train(unit))

    assert response.status_code == 201
    receipt = Receipt.objects.get(unit_id=unit["id"])
    assert receipt.verification["reexecute"] == {"rate": 1.0, "chosen": True}
    assert receipt.status == Receipt.Status.ACCEPTED  # eager Celery: the validator already agreed
    assert receipt.verification["reexecution"]["distance"] < 1e-6
    assert Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit_id=unit["id"]).count() == 1
    assert Device.objects.get(pk=device.device.pk).verified_streak == 1


def test_work_that_was_not_done_as_claimed_fails_reexecution_and_earns_nothing(customer_api, digits_dataset,
                                                                                make_device):
    cheater = make_device("cheater")
    create_job(customer_api, digits_dataset["id"], rounds=1)
    unit = cheater.claim()

    # trains on the first half of the shard only, but claims all of it
    weights, receipt = cheater.train({**unit})
    x = cheater.decoded(unit, weights)
    response = cheat(cheater, unit, lambda s: s.update({k: (x[k] + s[k]) / 2 if v.is_floating_point() else v
                                                        for k, v in s.items()}) or _perturb(s))

    assert response.status_code == 201  # passes the cheap checks...
    receipt = Receipt.objects.get(unit_id=unit["id"])
    assert receipt.status == Receipt.Status.REJECTED  # ...but not the re-execution
    assert receipt.reason.startswith("reexecution_mismatch")
    assert WorkUnit.objects.get(pk=unit["id"]).status == WorkUnit.Status.QUEUED  # back in the queue
    assert not Transaction.objects.filter(kind=Transaction.Kind.CHARGE).exists()
    assert Device.objects.get(pk=cheater.device.pk).failures == 1


def _perturb(state):
    first = next(k for k in state if k.endswith("weight"))
    state[first] = state[first] * 1.01


@pytest.mark.parametrize("change, code", [
    (lambda s, g: s.update(g), "no_training"),
    (lambda s, g: s.update({k: 2 * g[k] - v if v.is_floating_point() else v for k, v in s.items()}),
     "loss_not_improved"),
])
def test_untrained_or_sign_flipped_updates_fail_the_cheap_checks(customer_api, digits_dataset, make_device,
                                                                 change, code):
    device = make_device()
    create_job(customer_api, digits_dataset["id"], rounds=1)
    unit = device.claim()
    glob = tensors.bytes_to_state_dict(b"".join(device.client.get(
        f"/api/worker/units/{unit['id']}/weights").streaming_content))

    response = cheat(device, unit, lambda s: change(s, glob))

    assert response.status_code == 400 and response.json()["error"]["code"] == code
    assert Receipt.objects.get(unit_id=unit["id"]).status == Receipt.Status.REJECTED
    assert WorkUnit.objects.get(pk=unit["id"]).status == WorkUnit.Status.QUEUED  # back for another device


def test_scaled_update_is_refused_once_the_job_has_a_record(customer_api, digits_dataset, make_device):
    scaler = make_device("scaler")
    create_job(customer_api, digits_dataset["id"], rounds=6)
    for _ in range(3):
        assert scaler.work_one()  # honest at first: the job learns what its updates look like
    unit = scaler.claim()
    glob = tensors.bytes_to_state_dict(b"".join(scaler.client.get(
        f"/api/worker/units/{unit['id']}/weights").streaming_content))

    response = cheat(scaler, unit, lambda s: s.update(
        {k: g + 100 * (s[k] - g) for k, g in glob.items() if g.is_floating_point()}))

    assert response.status_code == 400 and response.json()["error"]["code"] == "update_too_large"


def test_a_replayed_result_is_refused(customer_api, digits_dataset, make_device):
    device = make_device()
    create_job(customer_api, digits_dataset["id"], rounds=3)
    first = device.claim()
    weights, receipt = device.train(first)
    assert device.submit(first["id"], weights, receipt).status_code == 201
    second = device.claim()
    _, honest_receipt = device.train(second)

    response = device.submit(second["id"], weights, {**honest_receipt, "output_sha256": receipt["output_sha256"]})

    assert response.status_code == 400 and response.json()["error"]["code"] == "replayed_result"


def test_another_devices_copy_of_an_honest_result_does_not_get_the_honest_device_refused(
        customer_api, digits_dataset, make_device):
    honest, copier = make_device("honest"), make_device("copier")
    Device.objects.filter(pk=honest.device.pk).update(verified_streak=10_000)  # trusted: rarely re-executed
    create_job(customer_api, digits_dataset["id"], rounds=1)
    unit_h = honest.claim()
    unit_c = copier.claim()
    honest_bytes, honest_receipt = honest.train(unit_h)
    _, copier_receipt = copier.train(unit_c)
    # the copier submits the honest device's result for its own unit first...
    copied = copier.submit(unit_c["id"], honest_bytes, {**copier_receipt, "output_sha256": honest_receipt["output_sha256"]})

    original = honest.submit(unit_h["id"], honest_bytes, honest_receipt)  # ...then the honest device its own

    assert copied.status_code == 201  # the copy passes the cheap checks, is re-executed, and fails
    assert Receipt.objects.get(unit_id=unit_c["id"]).reason.startswith("reexecution_mismatch")
    assert original.status_code == 201
    receipt = Receipt.objects.get(unit_id=unit_h["id"])
    assert receipt.status == Receipt.Status.ACCEPTED
    assert Device.objects.get(pk=honest.device.pk).failures == 0


def test_a_result_colliding_with_another_devices_live_result_is_reexecuted_not_refused(
        customer_api, digits_dataset, make_device):
    from muninn.celery import app as celery_app

    honest, copier = make_device("honest"), make_device("copier")
    Device.objects.filter(pk=honest.device.pk).update(verified_streak=10_000)
    create_job(customer_api, digits_dataset["id"], rounds=1)
    unit_h, unit_c = honest.claim(), copier.claim()
    honest_bytes, honest_receipt = honest.train(unit_h)
    _, copier_receipt = copier.train(unit_c)
    celery_app.conf.task_always_eager = False  # the copy's re-execution has not run yet when the original arrives
    try:
        copier.submit(unit_c["id"], honest_bytes, {**copier_receipt, "output_sha256": honest_receipt["output_sha256"]})
    finally:
        celery_app.conf.task_always_eager = True
    from contributors import verification

    original = honest.submit(unit_h["id"], honest_bytes, honest_receipt)
    verification.unit_verify(unit_id=unit_c["id"])  # the validator gets to the copy

    assert original.status_code == 201
    receipt = Receipt.objects.get(unit_id=unit_h["id"])
    assert receipt.verification["same_bytes_as_receipt"] and receipt.verification["reexecute"]["chosen"]
    assert receipt.status == Receipt.Status.ACCEPTED and Device.objects.get(pk=honest.device.pk).failures == 0
    assert Receipt.objects.get(unit_id=unit_c["id"]).status == Receipt.Status.REJECTED


def test_implausible_training_time_is_refused(customer_api, digits_dataset, make_device):
    device = make_device()
    create_job(customer_api, digits_dataset["id"], rounds=1)
    unit = device.claim()
    weights, receipt = device.train(unit)

    response = device.submit(unit["id"], weights, {**receipt, "train_seconds": 3600.0})

    assert response.status_code == 400 and response.json()["error"]["code"] == "implausible_time"


def test_an_implausibly_fast_result_is_reexecuted_not_refused(customer_api, digits_dataset, make_device):
    device = make_device()
    Device.objects.filter(pk=device.device.pk).update(verified_streak=10_000, verified_total=100, samples_per_s=1.0)
    create_job(customer_api, digits_dataset["id"], rounds=1)
    unit = device.claim()

    response = device.submit(unit["id"], *device.train(unit))  # thousands of samples/s against a record of 1

    assert response.status_code == 201
    receipt = Receipt.objects.get(unit_id=unit["id"])
    assert receipt.verification["implausibly_fast"] and receipt.verification["reexecute"]["chosen"]
    assert receipt.status == Receipt.Status.ACCEPTED  # honest, so the re-execution agrees


def test_repeated_failures_quarantine_the_device_and_its_verified_earnings_stay_its_own(
        customer_api, digits_dataset, make_device, customer, staff):
    device = make_device("turncoat")
    create_job(customer_api, digits_dataset["id"], rounds=5)
    assert device.work_one()  # one honest, credited unit first (a new device's: re-executed, so verified)
    assert receipt_was_checked(Receipt.objects.get(device=device.device, status=Receipt.Status.ACCEPTED))
    earned = ledger.balances_for(user=device.device.owner)["contributor_pending"]
    assert earned > 0
    glob_of = lambda u: tensors.bytes_to_state_dict(b"".join(device.client.get(  # noqa: E731
        f"/api/worker/units/{u['id']}/weights").streaming_content))

    for _ in range(3):  # a sign-flipped update, three times (each refusal sends the unit back to the queue)
        unit = device.claim()
        glob = glob_of(unit)
        response = cheat(device, unit, lambda s, g=glob: s.update(
            {k: 2 * v - s[k] for k, v in g.items() if v.is_floating_point()}))
        assert response.status_code == 400

    quarantined = Device.objects.get(pk=device.device.pk)
    assert quarantined.quarantined_at is not None and "loss_not_improved" in quarantined.quarantine_reason
    claim = device.client.post("/api/worker/claim", {}, format="json")
    assert claim.status_code == 403 and claim.json()["error"]["code"] == "device_quarantined"
    # Verified work is not suspect: its earnings stay pending, neither held nor forfeited (tests/test_earnings_held.py
    # has what happens to unverified work).
    assert ledger.balances_for(user=device.device.owner)["contributor_pending"] == earned
    assert not Transaction.objects.filter(kind__in=[Transaction.Kind.FORFEIT, Transaction.Kind.EARNINGS_HOLD]).exists()
    assert ledger.ledger_total() == 0

    contributors.device_lift_quarantine(device=quarantined, staff=staff, reason="reviewed: owner fixed it")
    assert device.client.post("/api/worker/claim", {}, format="json").status_code in (200, 204)
    assert list(DeviceEvent.objects.filter(device=quarantined).values_list("kind", flat=True))[:2] == [
        "lifted", "quarantined"]


def test_trusted_devices_are_reexecuted_rarely(customer_api, digits_dataset, make_device):
    device = make_device()
    Device.objects.filter(pk=device.device.pk).update(verified_streak=10_000)
    job = create_job(customer_api, digits_dataset["id"], rounds=20)

    run_until_done([device], job["id"])

    chosen = [r.verification["reexecute"]["chosen"] for r in Receipt.objects.filter(status="accepted")]
    assert len(chosen) == 20 and sum(chosen) <= 5  # rate 5%: a handful at most


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "norm_clip"])
def test_jobs_run_with_a_robust_aggregation_rule(customer_api, digits_dataset, make_device, rule):
    devices = [make_device(f"d{i}") for i in range(3)]
    job = create_job(customer_api, digits_dataset["id"], rounds=2, aggregation=rule)

    done = run_until_done(devices, job["id"])

    assert done.status == Job.Status.SUCCEEDED and done.aggregation == rule
    assert done.metrics["test_accuracy"] > 0.8
    assert_ledger_consistent(done)


def _run_market(devices, malicious, job_id: int) -> Job:
    """Every device works in turn until the job ends; malicious ones sign-flip their updates."""
    for _ in range(400):
        job = Job.objects.get(pk=job_id)
        if job.is_ended:
            return job
        for device in devices:
            claim = device.client.post("/api/worker/claim", {}, format="json")
            if claim.status_code != 200:
                continue
            unit = claim.json()["unit"]
            if device in malicious:
                glob = tensors.bytes_to_state_dict(b"".join(device.client.get(
                    f"/api/worker/units/{unit['id']}/weights").streaming_content))
                cheat(device, unit, lambda s, g=glob: s.update(
                    {k: 2 * v - s[k] for k, v in g.items() if v.is_floating_point()}))
            else:
                assert device.submit(unit["id"], *device.train(unit)).status_code == 201
    raise AssertionError("the job did not finish")


def test_a_fifth_of_malicious_devices_costs_less_than_a_point_of_accuracy(customer_api, digits_dataset, make_device):
    devices = [make_device(f"d{i}") for i in range(5)]
    honest_job = create_job(customer_api, digits_dataset["id"], rounds=3, aggregation="trimmed_mean")
    honest = _run_market(devices, [], honest_job["id"])
    # the same market, where one device in five (trusted by now: rarely re-executed) turns malicious
    Device.objects.filter(pk=devices[0].device.pk).update(verified_streak=10_000)
    attacked_job = create_job(customer_api, digits_dataset["id"], rounds=3, aggregation="trimmed_mean")

    attacked = _run_market(devices, devices[:1], attacked_job["id"])

    assert honest.status == attacked.status == Job.Status.SUCCEEDED
    assert attacked.metrics["test_accuracy"] >= honest.metrics["test_accuracy"] - 0.01
    assert not Receipt.objects.filter(device=devices[0].device, unit__round__job=attacked,
                                      status=Receipt.Status.ACCEPTED).exists()
    assert_ledger_consistent(attacked)


def test_update_norms_are_bounded_per_optimizer_step_so_a_big_shard_is_not_a_scaling_attack():
    from contributors import checks

    bound = checks.norm_bound([0.01, 0.011, 0.012])  # per step, from units of 30 steps
    # An honest fast device's shard took 10× the steps: its whole update is ~10× longer, its steps are not.
    checks.check_update_norm(3.3, bound, per_step=3.3 / 300)
    with pytest.raises(checks.ResultRejected) as refused:  # the same length in 30 steps is a scaled update
        checks.check_update_norm(3.3, bound, per_step=3.3 / 30)
    assert refused.value.code == "update_too_large"


def test_the_site_counts_a_units_steps_itself(customer_api, digits_dataset, make_device):
    make_device("a")
    job = create_job(customer_api, digits_dataset["id"], rounds=1, epochs=2, batch_size=32)
    unit = WorkUnit.objects.get(round__job_id=job["id"])
    assert jobs_services.unit_steps(unit) == 2 * -(-unit.samples // 32)
    Job.objects.filter(pk=job["id"]).update(inner_steps=7)
    assert jobs_services.unit_steps(WorkUnit.objects.get(pk=unit.pk)) == 7
