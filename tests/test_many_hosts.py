"""The site as several machines: two web servers on one database and one broker, two Celery workers (one
for the "validation" queue only, as its own machine would be) and beat, each process with its own local folder
(MUNINN_VAR_DIR) as if on its own host, sharing only what a deployment shares: the database, the broker, the
blob storage and the secret key. Devices talk to different servers; a job completes with no unit leased to two
devices at once and every unit charged once. Once with Redis as the broker (and the rate-limit cache), once with
RabbitMQ and no Redis at all (wake-ups then do not cross machines: waiting claims re-check every second)."""
from __future__ import annotations

import pytest
from django.conf import settings
from django.utils import timezone
from kombu import Connection

from accounts import services as accounts
from contributors.models import Receipt
from contributors.selectors import units_leased_twice
from jobs.models import Job
from muninn.celery import app as celery_app
from scripts.stack import Stack, base_env, free_port

from . import invariants
from .conftest import digits_npz
from .test_e2e import customer_session, database_url, market, wait_until_ended, wait_until_polling  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


def _purge(broker_url: str) -> None:
    """Drop messages a previous run may have left on the broker."""
    with Connection(broker_url, connect_timeout=5) as conn:
        channel = conn.default_channel
        for queue in ("celery", "validation"):
            try:
                channel.queue_purge(queue)
            except Exception:  # noqa: BLE001 - a queue that does not exist yet holds nothing
                channel = conn.channel()


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_two_web_servers_and_two_celery_workers_run_a_job_for_devices_on_both(tmp_path, market, broker):  # noqa: F811
    if not settings.CELERY_BROKER_URL.startswith("redis://"):
        pytest.fail("this test needs Redis and RabbitMQ: run it through `make test`")
    customer, contributor = market
    broker_url = settings.CELERY_BROKER_URL if broker == "redis" else RABBITMQ_URL
    _purge(broker_url)
    celery_app.conf.task_always_eager = False
    shared = dict(DATABASE_URL=database_url(), CELERY_BROKER_URL=broker_url, MEDIA_ROOT=str(tmp_path / "storage"),
                  DEBUG="1", SECRET_KEY="many-hosts-shared-secret", MUNINN_LEASE_SECONDS="30", LOG_LEVEL="INFO")
    if broker == "redis":  # the rate limits count across both servers
        base, _, db = settings.CELERY_BROKER_URL.rpartition("/")
        shared["CACHE_URL"] = f"{base}/{(int(db or 0) + 3) % 16}"  # beside the broker (tests/parallel.py)
    else:  # nothing of Redis: the wake-ups' carrier is each host's own stamp file
        shared["MUNINN_WAKEUP_REDIS_URL"] = ""

    def host(name: str) -> dict[str, str]:
        return base_env(**shared, MUNINN_VAR_DIR=str(tmp_path / name / "var"))

    with Stack(env=host("beat"), log_dir=tmp_path / "log") as stack:
        urls = [stack.web(free_port(), name=f"web-{i}", env=host(f"web-{i}"), workers=1, threads=12) for i in (1, 2)]
        stack.celery_worker("celery-main", env=host("celery-main"), queues="celery")
        stack.celery_worker("celery-validation", env=host("celery-validation"), queues="validation")
        stack.celery_beat()
        token = accounts.token_for(user=contributor)
        devices = {f"device-{i}": url for i, url in enumerate(urls, start=1)}
        started = timezone.now()
        for name, url in devices.items():
            stack.worker_client(name, stack.register_device(url, token, name), "--threads", "1",
                                "--poll-interval", "0.2")
        wait_until_polling(list(devices), started)
        api = customer_session(customer)
        dataset = api.post(f"{urls[0]}/api/datasets", files={"file": ("digits.npz", digits_npz())}).json()
        job = api.post(f"{urls[1]}/api/jobs", json={"dataset": dataset["id"], "template": "mlp", "rounds": 3,
                                                     "seed": 5, "start": True}).json()
        job = wait_until_ended(api, urls[0], job)
        names = ["web-1", "web-2", "celery-main", "celery-validation", "celery-beat", *devices]
        logs = "\n".join(f"--- {n}\n{stack.log(n)[-2500:]}" for n in names)

    assert job["status"] == "succeeded", logs
    done = Job.objects.get(pk=job["id"])
    invariants.assert_ledger_invariants(done)  # every accepted unit charged once, within the quote
    accepted = Receipt.objects.filter(unit__round__job=done, status=Receipt.Status.ACCEPTED)
    assert {r.device.name for r in accepted} == set(devices), logs  # each server took results
    assert all(r.verification["segment_check"]["passed"] for r in accepted)  # checked by the validation worker
    ran = lambda worker, task: f"Task {task}[" in stack.log(worker)  # noqa: E731 - its "received"/"succeeded" lines
    assert ran("celery-validation", "contributors.tasks.verify_unit")
    assert not ran("celery-main", "contributors.tasks.verify_unit") and ran("celery-main", "jobs.tasks.aggregate_round")
    assert units_leased_twice(lease_seconds=30) == []  # no unit held by two devices at once
