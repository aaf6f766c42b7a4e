"""The attack suite: real cheating worker clients, one device per class of cheating (threads of one process: one
adversary's machine), against a live site
(the web server, a Celery worker with the validation queue, beat) beside honest devices with different thread
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

from .attacks.cheater import STRATEGIES, register
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


def cheater_log(running, strategy: str) -> str:
    """The lines of one cheating device (its thread and its heartbeat thread) in the cheaters' shared log."""
    return "".join(line for line in running.log("cheaters").splitlines(keepends=True)
                   if f" cheat-{strategy} " in line or f" cheat-{strategy}-heartbeat " in line)


def test_every_class_of_cheating_is_refused_and_the_job_still_finishes(stack, market):  # noqa: F811
    # Twelve cheating strategies under one account (one adversary running them all): above the default limit
    # of devices per account, which tests/test_device_registration.py pins.
    # A unit refused again and again backs off 0.5 s, 1 s, ... up to 4 s here, not up to a minute: the
    # backoff itself is tests/test_verification.py's; here it would only keep honest devices waiting.
    stack.env.update(MUNINN_LEASE_SECONDS="8", MUNINN_RESERVATION_SECONDS="10", MUNINN_MAX_DEVICES_PER_ACCOUNT="20",
                     MUNINN_UNIT_BACKOFF_SECONDS="0.5", MUNINN_UNIT_BACKOFF_MAX_SECONDS="4")
    customer, contributor = market
    mallory = accounts.user_create(username="mallory", password="mallory-pass-1", role=User.Role.CONTRIBUTOR)
    url = stack.web(free_port())
    stack.celery_worker()
    stack.celery_beat()
    honest = {name: stack.register_device(url, accounts.token_for(user=contributor), name)
              for name in ("honest-1-thread", "honest-f64")}
    # the adversary's twelve devices are registered by one process with one probe (tests/attacks/cheater.py)
    cheaters = register(url, accounts.token_for(user=mallory), {s: f"cheat-{s}" for s in STRATEGIES}, stack.log_dir)
    api = customer_session(customer)
    dataset = api.post(f"{url}/api/datasets", files={"file": ("digits.npz", digits_npz())}).json()

    started = timezone.now()
    # the second honest device has other arithmetic (float64 rounded to float32 every step) and threads
    for name, extra in (("honest-1-thread", ("--threads", "1")), ("honest-f64", ("--threads", "2", "--numerics", "f64"))):
        stack.worker_client(name, honest[name], *extra, "--poll-interval", "0.2")
    stack.spawn("cheaters", [sys.executable, "-m", "tests.attacks.cheater", "--cache-dir", str(stack.log_dir / "cache"),
                             *(f"--device={s}={config}" for s, config in cheaters.items())])
    wait_until_polling([*honest, *(f"cheat-{s}" for s in STRATEGIES)], started)  # each device gets a shard
    job = api.post(f"{url}/api/jobs", json={"dataset": dataset["id"], "template": "mlp", "rounds": 3, "seed": 2,
                                            "start": True}).json()
    # twelve cheaters' results are checked segment by segment (odd ones in every segment) by one validator
    job = wait_until_ended(api, url, job, timeout=420)
    logs = "\n".join(f"--- {n}\n{stack.log(n)[-1500:]}" for n in ("web", "celery-worker", "honest-1-thread"))

    assert job["status"] == "succeeded", logs
    assert job["metrics"]["test_accuracy"] >= 0.85
    # Every cheater was polling, warm, when the first round opened (each got a shard reserved for it) and
    # heartbeats while it works: each had work, and at least one of its results reached the checks.
    idle = [s for s in STRATEGIES if not Device.objects.get(name=f"cheat-{s}").leases.exists()]
    late = [s for s in STRATEGIES if s not in idle and unjudged(Device.objects.get(name=f"cheat-{s}"), s)]
    assert not idle and not late, ("cheaters that never got work", idle, "or whose every result came too late to "
                                   "be checked", late, {s: cheater_log(stack, s)[-800:] for s in idle + late})
    for strategy in STRATEGIES:
        device = Device.objects.get(name=f"cheat-{strategy}")
        codes = refusal_codes(device)
        planned = WorkUnit.objects.filter(preferred_device_id=device.pk).count()
        assert codes & EXPECTED[strategy], (strategy, codes, f"{device.leases.count()} leases, {planned} units "
                                            f"planned for it", cheater_log(stack, strategy)[-2000:])
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
