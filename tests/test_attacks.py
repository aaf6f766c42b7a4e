"""The attack suite: real cheating worker-client processes, one per class of cheating, against a live site
(gunicorn, a Celery worker with the validation queue, beat) beside honest devices with different thread
counts and arithmetic. Every cheat is refused with its reason and earns nothing; the job still finishes; no
honest result is ever rejected."""
from __future__ import annotations

import sys

import pytest
from django.utils import timezone

from accounts import services as accounts
from accounts.models import User
from billing import selectors as ledger
from billing.models import Transaction
from contributors.models import Device, DeviceEvent, Receipt
from jobs.models import Job, WorkUnit
from scripts.stack import free_port

from .attacks.cheater import STRATEGIES
from .conftest import digits_npz
from .test_e2e import customer_session, market, stack, wait_until_ended, wait_until_polling  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

# What each cheat must be refused for (any of these codes, in a rejected receipt or a refused request).
EXPECTED = {
    "no_training": {"no_training", "replayed_result"},
    # Cheap checks that honest training can fail (a rising loss, a large norm) are evidence, not verdicts:
    # these are refused by re-training the segments they lied in.
    "partial_shard": {"reexecution_mismatch"},
    "random_noise": {"reexecution_mismatch"},
    "scaled": {"reexecution_mismatch"},
    "sign_flip": {"reexecution_mismatch"},
    # Replayed bytes are refused as a replay when the first copy is on record; when it never was (its upload came
    # after its lease was lost, as on a loaded machine), the receipt, which commits to this unit's own training,
    # names another result than the upload: chain_mismatch.
    "replay": {"replayed_result", "reexecution_mismatch", "chain_mismatch"},
    "forged_signature": {"bad_signature"},
    "other_lease": {"lease_lost", "not_found"},
    "nan": {"reexecution_mismatch"},  # re-trained whole: finite here, so not a diverging job
    "wrong_shape": {"wrong_shape"},
    "oversized": {"too_large"},
    "pickle": {"not_safetensors"},
}


def refusal_codes(device: Device) -> set[str]:
    rejected = {r.reason.split(":")[0] for r in device.receipts.filter(status=Receipt.Status.REJECTED)}
    refused = {e.reason.split(": ")[1] for e in device.events.filter(kind=DeviceEvent.Kind.REFUSED)}
    return rejected | refused


TOO_LATE = {"lease_lost", "unit_cancelled", "already_done"}  # refused before any check looked at the result


def unjudged(device: Device, strategy: str) -> bool:
    """No result of the device reached a check: nothing on record but refusals for coming too late."""
    codes = refusal_codes(device)
    return not device.receipts.exists() and codes <= TOO_LATE and not codes & EXPECTED[strategy]


def test_every_class_of_cheating_is_refused_and_the_job_still_finishes(stack, market):  # noqa: F811
    # Twelve cheating strategies under one account (one adversary running them all): above the default limit
    # of devices per account, which tests/test_device_registration.py pins.
    stack.env.update(MUNINN_LEASE_SECONDS="8", MUNINN_RESERVATION_SECONDS="3", MUNINN_MAX_DEVICES_PER_ACCOUNT="20")
    customer, contributor = market
    mallory = accounts.user_create(username="mallory", password="mallory-pass-1", role=User.Role.CONTRIBUTOR)
    url = stack.web(free_port())
    stack.celery_worker()
    stack.celery_beat()
    honest = {name: stack.register_device(url, accounts.token_for(user=contributor), name)
              for name in ("honest-1-thread", "honest-f64")}
    cheaters = {s: stack.register_device(url, accounts.token_for(user=mallory), f"cheat-{s}") for s in STRATEGIES}
    api = customer_session(customer)
    dataset = api.post(f"{url}/api/datasets", files={"file": ("digits.npz", digits_npz())}).json()

    started = timezone.now()
    # the second honest device has other arithmetic (float64 rounded to float32 every step) and threads
    for name, extra in (("honest-1-thread", ("--threads", "1")), ("honest-f64", ("--threads", "2", "--numerics", "f64"))):
        stack.worker_client(name, honest[name], *extra, "--poll-interval", "0.2")
    for strategy, config in cheaters.items():
        stack.spawn(f"cheat-{strategy}", [sys.executable, "-m", "tests.attacks.cheater", "--config", str(config),
                                          "--cache-dir", str(stack.log_dir / f"cache-{strategy}"),
                                          "--strategy", strategy])
    wait_until_polling([*honest, *(f"cheat-{s}" for s in STRATEGIES)], started)  # each device gets a shard
    job = api.post(f"{url}/api/jobs", json={"dataset": dataset["id"], "template": "mlp", "rounds": 3, "seed": 2,
                                            "start": True}).json()
    # twelve cheaters' results are checked segment by segment (odd ones in every segment) by one validator
    job = wait_until_ended(api, url, job, timeout=420)
    logs = "\n".join(f"--- {n}\n{stack.log(n)[-1500:]}" for n in ("web", "celery-worker", "honest-1-thread"))

    assert job["status"] == "succeeded", logs
    assert job["metrics"]["test_accuracy"] >= 0.85
    idle = [s for s in STRATEGIES if not Device.objects.get(name=f"cheat-{s}").leases.exists()]
    # A cheater leased work but every result it sent came too late to be looked at (its lease expired, or the
    # shard's other copy was accepted first): the faster the honest devices, the likelier on a loaded machine,
    # where a cheater's first unit pays torch's start-up and has no heartbeat.
    late = [s for s in STRATEGIES if s not in idle and unjudged(Device.objects.get(name=f"cheat-{s}"), s)]
    assert len(idle) + len(late) <= 2, ("cheaters that never got work (not polling when the rounds opened)", idle,
                                        "or whose every result came too late to be checked", late)
    for strategy in STRATEGIES:
        device = Device.objects.get(name=f"cheat-{strategy}")
        if strategy in idle or strategy in late:
            continue  # no work of it was judged on this run (a loaded machine): nothing to check
        codes = refusal_codes(device)
        planned = WorkUnit.objects.filter(preferred_device_id=device.pk).count()
        assert codes & EXPECTED[strategy], (strategy, codes, f"{device.leases.count()} leases, {planned} units "
                                            f"planned for it", stack.log(f"cheat-{strategy}")[-2000:])
    honest_devices = Device.objects.filter(name__startswith="honest-")
    # A late copy of a shard another device finished first is kept as "superseded", not held against its device
    # (a loaded machine makes stragglers); every other rejection of honest work is a false one.
    wrongly = Receipt.objects.filter(device__in=honest_devices, status=Receipt.Status.REJECTED).exclude(
        reason__startswith="superseded:")
    assert not wrongly.exists(), [(r.device.name, r.unit_id, r.reason, r.verification) for r in wrongly]
    assert all(d.failures == 0 for d in honest_devices)  # false rejections: 0

    done = Job.objects.get(pk=job["id"])
    assert ledger.ledger_total() == 0
    for charge in Transaction.objects.filter(kind=Transaction.Kind.CHARGE, job=done):
        accepted = Receipt.objects.get(unit=charge.unit, status=Receipt.Status.ACCEPTED)
        if accepted.device.owner == mallory:  # a cheater is credited only for honest work: the replayer's
            assert accepted.device.name == "cheat-replay"  # first unit, whose bytes it replayed later
            assert Receipt.objects.filter(output_sha256=accepted.output_sha256).order_by("id").first() == accepted
    money = ledger.job_money(job=done)
    assert money["charged"] <= money["quoted"] and money["held"] == 0
