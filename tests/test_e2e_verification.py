"""Verification end to end, with real processes on one live stack (the web server, a Celery worker consuming the
validation queue, beat, `muninn-worker` processes and a cheating client, all over HTTP):

- a worker whose arithmetic differs from the validator's (float64 rounded to float32 every step, the stand-in
  for another device's hardware) trains a job to the end beside a native one: every unit accepted and
  credited, nobody punished;
- the newcomer's job (MLP [64, 32], lr 0.05, momentum 0.9 on digits, whose honest units can raise their shard
  loss) finishes with both honest devices unpunished and paid, while a cheater in the same job is refused;
- a job whose learning rate makes it diverge fails with a message the customer can act on, no device penalised;
- a job no online device can run (resnet18 needs CUDA) is failed after the wait limit, its hold released.
"""
from __future__ import annotations

import sys

import pytest
from django.utils import timezone

from accounts import services as accounts
from accounts.models import User
from billing import selectors as ledger
from billing.models import Transaction
from contributors.models import Device, Receipt
from jobs.models import Job, WorkUnit
from scripts.stack import free_port

from . import invariants
from .conftest import digits_npz
from .test_e2e import customer_session, market, stack, wait_until_ended, wait_until_polling  # noqa: F401
from .test_templates_flow import shapes_zip

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
HONEST = ("honest-native", "honest-f64")


def _start_job(api, url: str, dataset: int, **fields) -> dict:
    response = api.post(f"{url}/api/jobs", json={"dataset": dataset, "start": True, "seed": 5, **fields})
    assert response.status_code == 201, response.text
    return response.json()


def _honest_devices_clean() -> None:
    for device in Device.objects.filter(name__in=HONEST):
        assert device.failures == 0 and device.quarantined_at is None, (device.name, device.quarantine_reason)
        # refused only as a copy that lost the race (superseded) or as work of a diverging job, never as wrong
        wrong = device.receipts.filter(status=Receipt.Status.REJECTED).exclude(
            reason__startswith="superseded").exclude(reason__startswith="training_diverges")
        assert not wrong.exists(), list(wrong.values_list("reason", flat=True))


def test_honest_devices_of_any_arithmetic_are_paid_cheaters_refused_and_no_job_waits_forever(stack, market):  # noqa: F811
    stack.env.update(MUNINN_JOB_WAIT_LIMIT="8", MUNINN_WAIT_CHECK_SECONDS="1", MUNINN_UNIT_BACKOFF_SECONDS="1",
                     MUNINN_RESERVATION_SECONDS="3")
    customer, contributor = market
    mallory = accounts.user_create(username="mallory", password="mallory-pass-1", role=User.Role.CONTRIBUTOR)
    url = stack.web(free_port())
    stack.celery_worker()
    stack.celery_beat()
    token = accounts.token_for(user=contributor)
    configs = {name: stack.register_device(url, token, name) for name in HONEST}
    started = timezone.now()
    stack.worker_client("honest-native", configs["honest-native"], "--threads", "1", "--poll-interval", "0.2")
    stack.worker_client("honest-f64", configs["honest-f64"], "--threads", "1", "--poll-interval", "0.2",
                        "--numerics", "f64")
    wait_until_polling(list(HONEST), started)
    api = customer_session(customer)
    digits = api.post(f"{url}/api/datasets", files={"file": ("digits.npz", digits_npz())}).json()["id"]

    def logs() -> str:
        return "\n".join(f"--- {n}\n{stack.log(n)[-2500:]}" for n in ("web", "celery-worker", *HONEST))

    # 1. Two honest devices, one with other arithmetic: every unit accepted and credited.
    first = wait_until_ended(api, url, _start_job(api, url, digits, template="mlp", rounds=3))
    assert first["status"] == "succeeded", logs()
    done = Job.objects.get(pk=first["id"])
    receipts = Receipt.objects.filter(unit__round__job=done).exclude(reason__startswith="superseded")
    assert receipts.exists() and all(r.status == Receipt.Status.ACCEPTED for r in receipts), logs()
    assert {r.device.name for r in receipts} == set(HONEST)
    assert all(Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit=r.unit).count() == 1 for r in receipts)
    assert any(s["distance"] > 0 for r in receipts.filter(device__name="honest-f64")
               for s in r.verification.get("segment_check", {}).get("segments", []))  # really other arithmetic
    invariants.assert_ledger_invariants(done)
    _honest_devices_clean()

    # 2. The newcomer's job, with a cheater (trains on a third of its shard, claims all of it) in the market.
    cheater = stack.register_device(url, accounts.token_for(user=mallory), "cheat-partial")
    stack.spawn("cheat-partial", [sys.executable, "-m", "tests.attacks.cheater", "--device", f"partial_shard={cheater}",
                                  "--cache-dir", str(stack.log_dir / "cache-cheat"), "--max-units", "20"])
    wait_until_polling(["cheat-partial"], timezone.now())
    second = wait_until_ended(api, url, _start_job(api, url, digits, template="mlp", rounds=3,
                                                   hparams={"hidden": [64, 32], "lr": 0.05, "momentum": 0.9}))
    assert second["status"] == "succeeded", logs() + stack.log("cheat-partial")[-2000:]
    done = Job.objects.get(pk=second["id"])
    cheat = Device.objects.get(name="cheat-partial")
    assert cheat.receipts.filter(status=Receipt.Status.REJECTED, reason__startswith="reexecution_mismatch").exists()
    assert not cheat.receipts.filter(status=Receipt.Status.ACCEPTED).exists()
    paid = {r.device.name for r in Receipt.objects.filter(unit__round__job=done, status=Receipt.Status.ACCEPTED)}
    assert paid == set(HONEST), paid
    invariants.assert_ledger_invariants(done)
    _honest_devices_clean()
    stack.stop("cheat-partial")

    # 3. A learning rate that makes training diverge: the job fails, with the customer's way out.
    third = wait_until_ended(api, url, _start_job(api, url, digits, template="mlp", rounds=3,
                                                  hparams={"lr": 10.0, "momentum": 0.99}))
    assert third["status"] == "failed", logs()
    assert third["error"].startswith("Training diverges") and "Lower the learning rate" in third["error"]
    diverged = Job.objects.get(pk=third["id"])
    money = ledger.job_money(job=diverged)
    assert money["held"] == 0 and money["charged"] == 0
    _honest_devices_clean()

    # 4. resnet18 runs only on CUDA, and no CUDA device is online: failed after the wait limit, hold released.
    shapes = api.post(f"{url}/api/datasets", files={"file": ("shapes.zip", shapes_zip())}).json()["id"]
    fourth = _start_job(api, url, shapes, template="resnet18", rounds=1,
                        hparams={"base_width": 8, "image_size": 16, "epochs": 1})
    assert "waiting" in api.get(f"{url}/api/jobs/{fourth['id']}").json()
    fourth = wait_until_ended(api, url, fourth)
    assert fourth["status"] == "failed", logs()
    assert "No device able to run this job" in fourth["error"], fourth["error"]
    stuck = Job.objects.get(pk=fourth["id"])
    assert ledger.job_money(job=stuck)["held"] == 0
    assert not WorkUnit.objects.filter(round__job=stuck).exclude(status=WorkUnit.Status.CANCELLED).exists()
    assert ledger.ledger_total() == 0
