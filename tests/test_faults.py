"""The fault suite: real processes (the web server, a Celery worker and beat on a private Redis, `muninn-worker`
clients) on the test's PostgreSQL database; each scenario runs a small real job, injects one fault at a chosen
moment, and checks that the job still succeeds, that every unit is credited at most once and that the books balance.

Faults land where they are meant to by failpoints (muninn_worker/failpoints.py): a process pauses at a named
place, prints `failpoint NAME reached`, and the test kills or restarts something then. One set of site processes
serves every scenario (a scenario that needs other site processes replaces them), so the suite stays within a
few minutes.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
from celery import Celery
from kombu import Connection
from psycopg.errors import DeadlockDetected
from django.conf import settings
from django.db import OperationalError, connection
from django.db.models import Q
from django.utils import timezone
from muninn_worker import codec, signing, tensors, training, zoo
from muninn_worker.api import ApiClient
from muninn_worker.challenge import CheckpointStore, answer_challenge
from muninn_worker.segments import Checkpoint
from muninn_worker.receipt import build_receipt, utc_now_iso
from muninn_worker.runner import _Heartbeat

from accounts import services as accounts
from accounts.models import User
from billing import money
from billing import services as billing
from billing.models import Transaction
from contributors import services as contributors
from contributors.models import Device, Lease, Receipt
from jobs import storage
from jobs.models import Job, Round, WorkUnit
from scripts.stack import STOP_GRACE_S, Stack, base_env, free_port, wait_http

from . import invariants
from .conftest import CAPABILITIES, digits_npz

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]
JOB_TIMEOUT_S = 150
LEASE_SECONDS = 6  # a dead device's unit is re-queued within a lease and a beat period (5 s)
STALL_SECONDS = 5  # beat's sweepers pick up lost messages this soon
SKEWED_CLOCK = Path(__file__).parent / "skewed_clock"
# A job small enough to take seconds, with two epochs per unit so that "mid-training" is a real moment.
HPARAMS = {"hidden": [32], "epochs": 2, "batch_size": 32, "lr": 0.05}
_names = itertools.count(1)


# --- the shared site: a private Redis, one database, web + Celery worker + beat -----------------------------

class PrivateRedis:
    """A redis-server of the suite's own (never the shared one), restartable on the same port."""

    def __init__(self, log_dir: Path):
        self.port, self.log_dir, self.proc = free_port(), log_dir, None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--daemonize", "no"],
                                     stdout=open(self.log_dir / "redis.log", "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not self._answers():
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()  # kill -9: whatever it held in memory is gone, as after a crash
            self.proc.wait()

    def restart(self, down_seconds: float = 1.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()

    def _answers(self) -> bool:
        try:
            out = subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True, text=True,
                                 timeout=2)
        except subprocess.TimeoutExpired:
            return False
        return out.stdout.strip() == "PONG"


def database_url() -> str:
    db = connection.settings_dict
    return f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


@dataclass
class Site:
    stack: Stack
    redis: PrivateRedis
    port: int
    url: str
    web_name: str = "web"
    worker_name: str = "celery-worker"
    broker: Celery = field(init=False)

    def __post_init__(self):
        self.broker = Celery("faults", broker=self.redis.url, set_as_current=False)  # for send_task

    def send_task(self, name: str, *args, queue: str = "celery"):
        """Deliver a task to the real worker through the private broker (an explicit connection: Celery prefers
        the CELERY_BROKER_URL of this process's environment, the shared Redis, to an app's own broker)."""
        with Connection(self.redis.url) as conn:
            return self.broker.send_task(name, args=list(args), queue=queue, connection=conn)

    def env(self, **overrides: str) -> dict[str, str]:
        return {**self.stack.env, **overrides}

    def settle(self, timeout: float = 20.0) -> bool:
        """Wait until the worker has run what it was sent, credit batches held back for MUNINN_CREDIT_BATCH_SECONDS
        included (they come due first, then a marker queued behind them runs): a task still running while the
        test's database is flushed deadlocks the flush. False when the worker did not get there (one a test
        left stopped)."""
        time.sleep(settings.MUNINN_CREDIT_BATCH_SECONDS + 0.2)
        marker = self.send_task("jobs.tasks.requeue_expired_leases")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if f"{marker.id}] succeeded" in self.stack.log(self.worker_name):
                return True
            time.sleep(0.1)
        return False

    def replace_celery_worker(self, **env: str) -> str:
        """Stop the Celery worker (SIGTERM: it finishes its task) and start another with this environment."""
        self.stack.stop(self.worker_name)
        self.worker_name = f"celery-worker-{next(_names)}"
        self.stack.celery_worker(self.worker_name, env=self.env(**env))
        return self.worker_name

    def restart_web(self, sig: int = signal.SIGKILL, **env: str) -> None:
        """The web server goes down (kill -9 by default: requests in flight are cut) and comes back on its port,
        with this environment (the site's own when none is given)."""
        self.stack.stop(self.web_name, sig)
        self.web_name = f"web-{next(_names)}"
        self.stack.web(self.port, name=self.web_name, env=self.env(**env) if env else None)

    def logs(self, *names: str) -> str:
        names = names or (self.web_name, self.worker_name, "celery-beat")
        return "\n".join(f"--- {n}\n{self.stack.log(n)[-4000:]}" for n in names)


@pytest.fixture(scope="module")
def site(django_db_setup, tmp_path_factory):
    """Started once for the module; each test's database is flushed after it, as for any transactional test,
    while these processes keep running (they hold no state of their own but the broker's messages)."""
    from muninn.celery import app as celery_app

    if connection.vendor != "postgresql":
        pytest.fail("the fault suite needs PostgreSQL: run it through `make test`")

    celery_app.conf.task_always_eager = False  # the module's own calls (job_start, ...) go to the real worker
    log_dir = tmp_path_factory.mktemp("faults")
    redis = PrivateRedis(log_dir)
    redis.start()
    env = base_env(DATABASE_URL=database_url(), CELERY_BROKER_URL=redis.url, MEDIA_ROOT=str(log_dir / "media"),
                   MUNINN_VAR_DIR=str(log_dir / "var"), DEBUG="1", LOG_LEVEL="INFO",
                   MUNINN_LEASE_SECONDS=str(LEASE_SECONDS), MUNINN_STALL_SECONDS=str(STALL_SECONDS),
                   # Longer than an idle client's longest poll (runner.MAX_IDLE_DELAY 5 s, +20 % jitter): each
                   # device must find its own shard before the other may take it.
                   MUNINN_RESERVATION_SECONDS="8", MUNINN_FAILPOINTS="", MUNINN_WORKER_FAILPOINTS="",
                   # Stragglers' backups are not what these scenarios inject: a unit slowed by a loaded machine
                   # must not be re-issued under them (tests/test_scheduling.py covers backups).
                   MUNINN_ROUND_DEADLINE_MIN_SECONDS="120",
                   # Veterans' results accepted unchecked and charged by the credit task (kill_mid_credit) exist
                   # only under a lowered check floor; new devices are checked every time at any floor.
                   MUNINN_MIN_CHECK_RATE="0.05")
    try:
        with Stack(env=env, log_dir=log_dir) as stack, _flush_retried_on_deadlock():
            port = free_port()
            stack.celery_worker()
            stack.celery_beat()
            running = Site(stack, redis, port, stack.web(port))
            yield running
            stack.stop(sig=signal.SIGKILL)  # nothing to finish: the database is flushed, the broker thrown away
    finally:
        redis.stop()
        celery_app.conf.task_always_eager = True


@contextmanager
def _flush_retried_on_deadlock(tries: int = 5):
    """Each test's database is flushed (one TRUNCATE of every table) while the site's processes keep running: beat
    sends its sweeps every few seconds, so a task may hold one table and want another the TRUNCATE already holds.
    PostgreSQL then cancels one of the two; when it is the flush, it is run again (the task's side rolled back or
    finished). Anything but a deadlock is raised at once."""
    ops_class = type(connection.ops)
    flush = ops_class.execute_sql_flush

    def retried(self, sql_list):
        for attempt in range(tries):
            try:
                return flush(self, sql_list)
            except OperationalError as exc:
                if not isinstance(exc.__cause__, DeadlockDetected) or attempt == tries - 1:
                    raise
                time.sleep(0.2 * (attempt + 1))

    ops_class.execute_sql_flush = retried
    try:
        yield
    finally:
        ops_class.execute_sql_flush = flush


@pytest.fixture(autouse=True)
def _shared_site(site):
    """conftest gives every test its own MEDIA_ROOT and eager tasks; here the test shares the site's files, and
    its tasks (job_cancel's, ...) go to the real worker."""
    from muninn.celery import app as celery_app

    settings.MEDIA_ROOT = site.stack.env["MEDIA_ROOT"]
    celery_app.conf.task_always_eager = False
    yield
    site.settle()  # before the flush


# --- one scenario ----------------------------------------------------------------------------------------------

@dataclass
class Scenario:
    site: Site
    customer: User
    contributor: User
    configs: dict[str, Path] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)  # the scenario's device names → this run's unique names
    job_id: int | None = None

    @property
    def stack(self) -> Stack:
        return self.site.stack

    def api(self) -> requests.Session:
        session = requests.Session()
        session.headers["Authorization"] = f"Token {accounts.token_for(user=self.customer)}"
        return session

    def register(self, name: str) -> Path:
        """A device with its key pair and token, saved as `muninn-worker register` saves them."""
        key = signing.new_private_key()
        device, token = contributors.device_register(owner=self.contributor, name=name, capabilities=CAPABILITIES,
                                                     public_key=signing.public_key_of(key))
        path = self.stack.log_dir / f"{name}.json"
        path.write_text(json.dumps({"server": self.site.url, "device_token": token, "device_id": device.pk,
                                    "name": name, "signing_key": key}))
        self.configs[name] = path
        return path

    def client(self, name: str, failpoints: str = "", clock_offset: int = 0) -> subprocess.Popen:
        env = self.site.env(MUNINN_WORKER_FAILPOINTS=failpoints)
        if clock_offset:
            env["PYTHONPATH"] = f"{SKEWED_CLOCK}:{env['PYTHONPATH']}"
            env["MUNINN_CLOCK_OFFSET_SECONDS"] = str(clock_offset)
        return self.stack.worker_client(name, self.configs[name], "--threads", "1", "--poll-interval", "0.2",
                                        env=env)

    def start_job(self, rounds: int = 2) -> int:
        api = self.api()
        dataset = api.post(f"{self.site.url}/api/datasets", files={"file": ("digits.npz", digits_npz(600))})
        assert dataset.status_code == 201, dataset.text
        job = api.post(f"{self.site.url}/api/jobs", json={
            "dataset": dataset.json()["id"], "template": "mlp", "rounds": rounds, "seed": next(_names),
            "hparams": HPARAMS, "start": True})
        assert job.status_code == 201, job.text
        self.job_id = job.json()["id"]
        return self.job_id

    def wait(self, condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting until {what}\n{self.site.logs()}"
            time.sleep(0.1)

    def wait_until_ended(self, on_poll: Callable[[], None] = lambda: None) -> Job:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not (job := Job.objects.get(pk=self.job_id)).is_ended and time.monotonic() < deadline:
            on_poll()
            time.sleep(0.2)
        return job


def run_scenario(site: Site, inject: Callable[[Scenario], None], *, clients: dict[str, dict] | None = None,
                 rounds: int, on_poll: Callable[[Scenario], None] | None = None, veterans: bool = False) -> Scenario:
    """Register the devices, start their worker clients (each with its failpoints or clock), run a job, call
    `inject` once it has started (it waits for its moment and injects the fault), wait for the job to end, and
    check what must hold after any fault. Returns the scenario for the checks particular to it."""
    n = next(_names)
    staff = accounts.user_create(username=f"ops{n}", password="ops-pass-123", role=User.Role.STAFF)
    customer = accounts.user_create(username=f"carol{n}", password="carol-pass-123", role=User.Role.CUSTOMER)
    contributor = accounts.user_create(username=f"dave{n}", password="dave-pass-123", role=User.Role.CONTRIBUTOR)
    billing.balance_grant(user=customer, amount=money.to_nanos("5"), reason="fault suite", granted_by=staff)
    scenario = Scenario(site, customer, contributor)
    clients = clients if clients is not None else {"device-1": {}, "device-2": {}}
    names = scenario.names = {name: f"{name}-{n}" for name in clients}
    for name in clients:
        scenario.register(names[name])
    if veterans:  # a long verified record: their results are accepted at once and charged by a credit task
        Device.objects.filter(name__in=names.values()).update(verified_streak=10_000, verified_total=10_000)
    since = timezone.now()
    spawned = [names[name] for name, options in clients.items() if options.get("spawn", True)]
    for name, options in clients.items():
        if options.get("spawn", True):
            scenario.client(names[name], **{k: v for k, v in options.items() if k != "spawn"})
    # Every device polls before the job starts, so that round 1 has a shard for each.
    scenario.wait(lambda: Device.objects.filter(name__in=spawned, last_seen_at__gte=since).count() == len(spawned),
                  "every worker client polls")
    try:
        scenario.start_job(rounds)
        inject(scenario)
        job = scenario.wait_until_ended((lambda: on_poll(scenario)) if on_poll else (lambda: None))
        logs = site.logs(site.web_name, site.worker_name, "celery-beat", *names.values())
        assert job.status == Job.Status.SUCCEEDED, f"job {job.pk} is {job.status}: {job.error}\n{logs}"
        assert list(job.round_set.order_by("number").values_list("number", "status")) == [
            (r, "closed") for r in range(1, rounds + 1)]
        assert all(r.metrics.get("test_accuracy") is not None for r in job.round_set.all())
        invariants.assert_ledger_invariants(job)
        assert not WorkUnit.objects.filter(round__job=job, status=WorkUnit.Status.VERIFYING).exists()
        return scenario
    finally:  # the database is flushed after the test; its worker clients go now
        for name in names.values():
            scenario.stack.stop(name, signal.SIGKILL)


def leased_unit_of(device_name: str) -> WorkUnit:
    return Lease.objects.filter(device__name=device_name).latest("id").unit


def accepted_copies(unit: WorkUnit) -> list[Receipt]:
    """The accepted receipts for a unit's shard: the unit itself (re-queued when its lease lapsed) or its
    backup (issued past the round's soft deadline), whichever another device finished first."""
    return list(Receipt.objects.filter(Q(unit=unit) | Q(unit__backup_of=unit), status=Receipt.Status.ACCEPTED))


# --- the scenarios --------------------------------------------------------------------------------------------

def test_worker_client_killed_mid_training_hands_its_unit_to_another_device(site):
    killed: dict = {}

    def kill_mid_training(s: Scenario) -> None:
        doomed = s.names["device-1"]
        s.stack.wait_for_log(doomed, "failpoint train.after_epoch reached")  # epoch 1 of 2 done
        s.stack.stop(doomed, signal.SIGKILL)
        killed["unit"] = leased_unit_of(doomed)

    s = run_scenario(site, kill_mid_training, rounds=1, clients={
        "device-1": {"failpoints": "train.after_epoch=1*sleep:300"}, "device-2": {}})

    assert [r.device.name for r in accepted_copies(killed["unit"])] == [s.names["device-2"]]  # once, by the other
    assert not Receipt.objects.filter(device__name=s.names["device-1"]).exists()


def test_worker_client_killed_mid_upload_leaves_nothing_behind(site):
    killed: dict = {}

    def kill_mid_upload(s: Scenario) -> None:
        doomed = s.names["device-1"]
        s.stack.wait_for_log(doomed, "failpoint upload.mid_body reached")  # half the body is on the wire
        s.stack.stop(doomed, signal.SIGKILL)
        killed["unit"] = leased_unit_of(doomed)

    s = run_scenario(site, kill_mid_upload, rounds=1, clients={
        "device-1": {"failpoints": "upload.mid_body=1*sleep:300"}, "device-2": {}})

    assert [r.device.name for r in accepted_copies(killed["unit"])] == [s.names["device-2"]]
    assert not Receipt.objects.filter(device__name=s.names["device-1"]).exists()
    wait_http(f"{site.url}/healthz", timeout=5)  # the truncated request did not take the web server down


def test_celery_worker_killed_mid_aggregation_the_round_is_aggregated_once(site):
    worker = site.replace_celery_worker(MUNINN_FAILPOINTS="aggregate.before_commit=1*sleep:300")

    def kill_mid_aggregation(s: Scenario) -> None:
        s.stack.wait_for_log(worker, "failpoint aggregate.before_commit reached", timeout=120)
        s.stack.stop(worker, signal.SIGKILL)  # the aggregation's transaction dies uncommitted, its message unacked
        assert Round.objects.get(job_id=s.job_id, number=1).status == Round.Status.OPEN
        site.replace_celery_worker()

    try:
        s = run_scenario(site, kill_mid_aggregation, rounds=2)  # round 2 shows the job carries on
    finally:
        if site.worker_name == worker:  # the scenario failed before the kill: no later one gets the failpoint
            site.replace_celery_worker()

    # The killed worker's message comes back only after the broker's visibility timeout: beat's sweeper did it.
    assert "never aggregated; aggregating it now" in site.stack.log(site.worker_name), site.logs()
    assert Job.objects.get(pk=s.job_id).metrics["round"] == 2


def test_celery_worker_killed_mid_credit_every_accepted_unit_is_charged_once(site):
    """Veterans' results are answered at once and charged by a task afterwards: killed before its transaction
    commits, the batch is lost whole, and beat's sweep (or the job's end) charges each unit once."""
    worker = site.replace_celery_worker(MUNINN_FAILPOINTS="credit.before_commit=1*sleep:300")
    seen: dict = {}

    def kill_mid_credit(s: Scenario) -> None:
        s.stack.wait_for_log(worker, "failpoint credit.before_commit reached", timeout=120)
        seen["pending"] = Receipt.objects.filter(unit__round__job_id=s.job_id, credit_pending=True).count()
        s.stack.stop(worker, signal.SIGKILL)  # the batch's transaction dies uncommitted
        site.replace_celery_worker()

    try:
        s = run_scenario(site, kill_mid_credit, rounds=2, veterans=True)
    finally:
        if site.worker_name == worker:
            site.replace_celery_worker()

    assert seen["pending"] >= 1  # the batch the kill interrupted was still owed when it died
    accepted = Receipt.objects.filter(unit__round__job_id=s.job_id, status=Receipt.Status.ACCEPTED)
    assert accepted.exists() and not accepted.filter(credit_pending=True).exists()
    for receipt in accepted:
        assert Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit_id=receipt.unit_id).count() == 1


def test_celery_worker_killed_mid_check_the_unit_is_neither_lost_nor_credited_twice(site):
    """A new device's result is answered at once and checked afterwards (its segment re-executed by a task):
    killed before the check's transaction commits, the receipt stays pending, and beat's sweep checks it again
    (verification.pending_units): accepted once, charged once, nothing lost."""
    worker = site.replace_celery_worker(MUNINN_FAILPOINTS="verify.before_commit=1*sleep:300")
    seen: dict = {}

    def kill_mid_check(s: Scenario) -> None:
        s.stack.wait_for_log(worker, "failpoint verify.before_commit reached", timeout=120)
        seen["pending"] = list(Receipt.objects.filter(unit__round__job_id=s.job_id, status=Receipt.Status.PENDING)
                               .values_list("unit_id", flat=True))
        s.stack.stop(worker, signal.SIGKILL)  # the check's transaction dies uncommitted, its message unacked
        site.replace_celery_worker()

    try:
        run_scenario(site, kill_mid_check, rounds=2)
    finally:
        if site.worker_name == worker:
            site.replace_celery_worker()

    assert seen["pending"]  # the check the kill interrupted had not decided its receipt
    for unit_id in seen["pending"]:
        assert Receipt.objects.filter(unit_id=unit_id, status=Receipt.Status.ACCEPTED).count() == 1
        assert Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit_id=unit_id).count() == 1
    # The killed worker's message comes back only after the broker's visibility timeout: beat's sweeper checked the
    # unit again, or a later task of another unit of its round did, in a batch beside its own.
    log = site.stack.log(site.worker_name)
    swept = "check has not finished (a lost or killed task, or a long queue); enqueued again" in log
    batched = {int(unit) for units in re.findall(r"results checked together \(units ([0-9, ]+)\)", log)
               for unit in units.split(", ")}
    assert swept or set(seen["pending"]) <= batched, site.logs()


def test_redis_restarted_mid_round_lost_messages_are_recovered(site):
    def restart_redis(s: Scenario) -> None:
        # Freeze the Celery worker while round 1's results come in, so their re-execution tasks wait in Redis...
        s.wait(lambda: WorkUnit.objects.filter(round__job_id=s.job_id).exists(), "round 1 is open")
        worker = next(p for n, p in site.stack.procs if n == site.worker_name)
        os.killpg(worker.pid, signal.SIGSTOP)
        try:
            s.wait(lambda: WorkUnit.objects.filter(round__job_id=s.job_id, status=WorkUnit.Status.VERIFYING).count()
                   == 2, "both results of round 1 wait for re-execution")
            site.redis.restart()  # ... and are lost with it (no persistence)
        finally:
            os.killpg(worker.pid, signal.SIGCONT)

    # Each client's first unit trains a second longer: the worker is frozen before any result is in (a result that
    # brings its last checkpoint along is checked at once, and a worker frozen mid-check holds the round's lock).
    slow_first_unit = {"failpoints": "train.after_epoch=1*sleep:1"}
    run_scenario(site, restart_redis, rounds=1, clients={"device-1": slow_first_unit, "device-2": slow_first_unit})

    assert "Connection to broker lost" in site.stack.log(site.worker_name), site.logs()


def test_web_server_restarted_mid_upload_the_client_sends_it_again(site):
    uploading: dict = {}

    def restart_web_mid_upload(s: Scenario) -> None:
        uploader = s.names["device-1"]
        s.stack.wait_for_log(uploader, "failpoint upload.mid_body reached")
        unit = uploading["unit"] = leased_unit_of(uploader)
        # What is tested is the resend, not the lease: the suite's 6 s lease is stretched so that it outlasts a
        # web restart on a loaded machine (5 s and more there: the resend then met "lease lost", and the client
        # trained the unit again). A lease that lapses is the dead-device scenarios'.
        WorkUnit.objects.filter(pk=unit.pk).update(lease_expires_at=timezone.now() + timezone.timedelta(minutes=2))
        site.restart_web()  # the upload in flight is cut; the client finds a new server when it sends again

    s = run_scenario(site, restart_web_mid_upload, rounds=1, clients={
        "device-1": {"failpoints": "upload.mid_body=1*sleep:3"}, "device-2": {}})

    # The client sent the upload again to the new server and got its one answer, and the unit is its own.
    unit, log = uploading["unit"], s.stack.log(s.names["device-1"])
    # (the client's answer lines: runner._record's, and the lease-lost one)
    answers = (": uploaded; ", ": accepted, earned ", ": the site's check refused it", "lease lost")
    answered = [line for line in log.splitlines() if line.split(" ", 1)[-1].startswith(f"unit {unit.pk}: ")
                and any(a in line for a in answers)]
    assert len(answered) == 1 and "lease lost" not in answered[0] and "giving it up" not in log, log
    assert "request failed" in log, log  # the first send was cut
    accepted = Receipt.objects.get(unit=unit, status=Receipt.Status.ACCEPTED)
    assert accepted.device.name == s.names["device-1"]


def test_web_server_killed_mid_blob_write_the_resent_result_is_stored_whole(site):
    """Killed after creating a result's file and before writing its bytes (jobs.storage: a blob's file is named by
    its bytes' hash, and created exclusively): the file is left empty. The client sends the result again to the new
    server, whose put of the same bytes finds that file; every blob a receipt names must be its bytes all the same
    (before jobs.storage._rewrite, the empty file was kept and the accepted receipt named it)."""
    torn: dict = {}

    def kill_web_mid_blob_write(s: Scenario) -> None:
        # (after the job's dataset went in through the web: the first blob the new server writes is a result's)
        site.restart_web(MUNINN_FAILPOINTS="blob.created=1*sleep:300")
        s.stack.wait_for_log(site.web_name, "failpoint blob.created reached", timeout=120)
        media = Path(site.stack.env["MEDIA_ROOT"]) / "blobs"
        torn["files"] = [p for p in media.rglob("*") if p.is_file() and p.stat().st_size == 0]
        # The resend, not a lapsed lease, is what is tested (as in the mid-upload restart above).
        WorkUnit.objects.filter(round__job_id=s.job_id, status=WorkUnit.Status.LEASED).update(
            lease_expires_at=timezone.now() + timezone.timedelta(minutes=2))
        site.restart_web()

    s = run_scenario(site, kill_web_mid_blob_write, rounds=1)

    assert torn["files"], "the web server was not stopped with a blob's file created and empty"
    named = set()
    for receipt in Receipt.objects.filter(unit__round__job_id=s.job_id).exclude(status=Receipt.Status.REJECTED):
        named |= {receipt.output_sha256, receipt.unit.result_sha256, *receipt.checkpoint_blobs.values()}
    assert {p.name for p in torn["files"]} <= named  # the torn file was a result's, sent again
    for sha in named - {""}:
        assert storage.sha256_hex(storage.blob_get(sha)) == sha


def test_web_server_killed_mid_claim_the_unit_is_leased_again(site):
    """A claim writes the unit's lease and then its Lease row, each committed at once (contributors.services.
    unit_claim): killed between the two, the unit is leased with no Lease row. Nobody can send its heartbeat or
    result, and it is not lost: its lease runs out and another claim takes it."""
    site.restart_web(MUNINN_FAILPOINTS="claim.before_lease_row=1*sleep:300")
    orphan: dict = {}

    def kill_web_mid_claim(s: Scenario) -> None:
        s.stack.wait_for_log(site.web_name, "failpoint claim.before_lease_row reached", timeout=120)
        leased = WorkUnit.objects.filter(round__job_id=s.job_id, status=WorkUnit.Status.LEASED)
        # (each of the web's two processes pauses its own first claim there: one or both devices' claims)
        orphan.update({u.pk: u.lease_token for u in leased.exclude(lease_token__in=Lease.objects.values("token"))})
        site.restart_web()  # the claims in flight are cut; their clients claim again from the new server

    run_scenario(site, kill_web_mid_claim, rounds=1)

    assert orphan, "no claim was cut between the unit's lease and its Lease row"
    for unit_id, token in orphan.items():
        unit = WorkUnit.objects.get(pk=unit_id)
        assert unit.status == WorkUnit.Status.ACCEPTED  # leased again once its lease ran out, and trained
        assert not Lease.objects.filter(unit=unit, token=token).exists()
        assert Receipt.objects.filter(unit=unit, status=Receipt.Status.ACCEPTED).count() == 1


def test_web_server_stopped_answers_its_held_claims_and_exits_at_once(site):
    """SIGTERM (a deploy, a service manager's restart): the server answers the long-poll claims it holds, 204, and
    exits; it does not hold them until its kill timeout cuts them (STOP_GRACE_S), their devices seeing a broken
    connection. (The wake-up comes through the site's Redis here, as in production.)"""
    n = next(_names)
    contributor = accounts.user_create(username=f"erin{n}", password="erin-pass-123", role=User.Role.CONTRIBUTOR)
    config = json.loads(Scenario(site, contributor, contributor).register(f"waiter-{n}").read_text())
    client = ApiClient(site.url, device_token=config["device_token"], signing_key=config["signing_key"])
    assert client.claim() is None  # nothing queued for anyone: a claim with a wait is held
    answer: dict = {}

    def hold() -> None:
        try:
            answer["unit"] = client.claim(wait=25)
        except Exception as e:  # kept: the assertion says what the device saw
            answer["error"] = repr(e)

    thread = threading.Thread(target=hold)
    thread.start()
    time.sleep(2)  # the claim reaches the server and is held
    stopping = time.monotonic()
    site.stack.stop(site.web_name, signal.SIGTERM)
    took = time.monotonic() - stopping
    thread.join(timeout=10)
    site.restart_web()  # back on its port for the next tests

    assert not thread.is_alive() and answer == {"unit": None}, (answer, site.logs(site.web_name))
    assert took < STOP_GRACE_S, f"the server took {took:.1f} s to stop: its held claims were cut, not answered"


def test_devices_whose_clocks_are_an_hour_off_get_honest_work_accepted(site):
    s = run_scenario(site, lambda s: None, rounds=1, clients={
        "ahead": {"clock_offset": 3600}, "behind": {"clock_offset": -3600}})

    accepted = Receipt.objects.filter(unit__round__job_id=s.job_id, status=Receipt.Status.ACCEPTED)
    assert {r.device.name for r in accepted} == {s.names["ahead"], s.names["behind"]}
    assert not Receipt.objects.filter(unit__round__job_id=s.job_id, status=Receipt.Status.REJECTED).exists()
    starts = {r.device.name: r.started_at for r in accepted}
    assert starts[s.names["ahead"]] - starts[s.names["behind"]] > timezone.timedelta(hours=1, minutes=59)


def test_the_same_result_delivered_twice_is_credited_once(site):
    """This device is the test itself, using the worker client's own HTTP client: one signed upload, delivered
    twice at the same moment (a client that timed out and retried while the site was still checking the first),
    then again in turn, then once more after the job has ended."""
    delivered: dict = {}

    def deliver_twice(s: Scenario) -> None:
        config = json.loads(s.configs[s.names["replayer"]].read_text())
        client = ApiClient(site.url, device_token=config["device_token"], signing_key=config["signing_key"])
        deadline = time.monotonic() + 30
        while (unit := client.claim()) is None:
            assert time.monotonic() < deadline, "no unit for the replayer"
            time.sleep(0.2)
        # As the worker client does, the lease is kept alive until the upload has its answer (a slow check
        # under load must not let it lapse).
        with _Heartbeat(client, unit["id"], unit["lease_seconds"]):
            weights, receipt, store = train_like_a_worker(client, unit, s.stack.log_dir / "replayer-cache")
            delivered["unit"] = unit["id"]
            delivered["send"] = lambda: client.submit_result(unit["id"], weights, receipt)
            barrier = threading.Barrier(2)
            answers: list = [None, None]

            def send(i: int) -> None:
                barrier.wait()
                try:
                    answers[i] = delivered["send"]()
                except Exception as e:  # kept, so the assertion below says what the site answered
                    answers[i] = {"error": repr(e)}

            threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            delivered["together"] = answers
            delivered["again"] = delivered["send"]()
            # New devices are checked: the challenge (the same in every answer) is answered once
            challenge = next((a["challenge"] for a in [*answers, delivered["again"]] if a.get("challenge")), None)
            if challenge is not None:
                answer_challenge(client, store, challenge)

    s = run_scenario(site, deliver_twice, rounds=1, clients={"replayer": {"spawn": False}, "device-2": {}})
    late = delivered["send"]()

    unit_id = delivered["unit"]
    for answer in [*delivered["together"], delivered["again"], late]:
        assert answer["unit"] == unit_id and answer["status"] in ("pending", "accepted"), answer
    assert late["status"] == "accepted"
    assert Receipt.objects.filter(unit_id=unit_id).count() == 1
    assert Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit_id=unit_id).count() == 1
    assert not Device.objects.get(name=s.names["replayer"]).events.exists()  # no failure held against it


def test_tasks_delivered_twice_change_nothing_the_first_did_not(site):
    sent: set = set()

    def send_twice(name: str, *args, queue: str = "celery") -> None:
        for _ in range(2):
            site.send_task(name, *args, queue=queue)
        sent.add((name, *args))

    def duplicate_live_tasks(s: Scenario) -> None:
        send_twice("jobs.tasks.open_round", s.job_id)

    def on_poll(s: Scenario) -> None:
        """While the job runs: every re-execution and every aggregation is delivered twice more, as soon as the
        site has sent its own (a duplicate comes after the original, mostly after it has run)."""
        done = [WorkUnit.Status.VERIFYING, WorkUnit.Status.ACCEPTED]
        for unit_id in WorkUnit.objects.filter(round__job_id=s.job_id, status__in=done).values_list("id", flat=True):
            if ("contributors.tasks.verify_unit", unit_id) not in sent:
                send_twice("contributors.tasks.verify_unit", unit_id, queue="validation")
        outstanding = [WorkUnit.Status.QUEUED, WorkUnit.Status.LEASED, WorkUnit.Status.VERIFYING]
        for rnd in Round.objects.filter(job_id=s.job_id).exclude(units__status__in=outstanding):
            if ("jobs.tasks.aggregate_round", rnd.pk) not in sent:
                send_twice("jobs.tasks.aggregate_round", rnd.pk)

    s = run_scenario(site, duplicate_live_tasks, rounds=2, on_poll=on_poll)

    done = Job.objects.get(pk=s.job_id)
    assert {name for name, *_ in sent} == {"jobs.tasks.open_round", "contributors.tasks.verify_unit",
                                           "jobs.tasks.aggregate_round"}, sent
    # Once more after the end, through the real worker: nothing moves.
    before = (done.global_weights_sha256, list(Transaction.objects.order_by("id").values_list("id", flat=True)),
              list(Round.objects.filter(job=done).values_list("id", "closed_at")))
    for rnd in done.round_set.all():
        send_twice("jobs.tasks.aggregate_round", rnd.pk)
    send_twice("jobs.tasks.open_round", done.pk)
    marker = site.send_task("jobs.tasks.requeue_expired_leases")  # runs after the duplicates (one worker)
    s.wait(lambda: f"{marker.id}] succeeded" in site.stack.log(site.worker_name), "the worker ran them all")
    done.refresh_from_db()
    after = (done.global_weights_sha256, list(Transaction.objects.order_by("id").values_list("id", flat=True)),
             list(Round.objects.filter(job=done).values_list("id", "closed_at")))
    assert after == before
    invariants.assert_ledger_invariants(done)


def train_like_a_worker(client: ApiClient, unit: dict, cache: Path) -> tuple[bytes, dict, CheckpointStore]:
    """What `muninn-worker run` does with a unit, in this process: download, train keeping a checkpoint at every
    segment boundary, build the receipt that commits to them. Returns the upload, the receipt and the
    checkpoints (to answer the site's challenge with)."""
    weights = client.download(unit["id"], "weights", unit["weights_sha256"], cache)
    shard = client.download(unit["id"], "shard", unit["shard_sha256"], cache)
    model = zoo.build_model(unit["template"], unit["model_config"])
    global_state = tensors.bytes_to_state_dict(weights)
    model.load_state_dict(global_state)
    X, y = tensors.bytes_to_shard(shard)
    started = utc_now_iso()
    store = CheckpointStore(cache, unit["id"])
    train = {k: v for k, v in unit["train"].items() if k != "segment_steps"}
    result = training.train_local(model, X, y, **train, segment_steps=unit["train"]["segment_steps"],
                                  on_boundary=store.keep)
    payload = codec.encode_update(result.state_dict, global_state, unit["encoding"])  # as the runner uploads it
    chain = store.seal(Checkpoint(result.state_dict, result.optimizer_state), global_state, unit["encoding"])
    receipt = build_receipt(unit, result, output_sha256=tensors.sha256_hex(payload), started_at=started,
                            finished_at=utc_now_iso(), segment_steps=unit["train"]["segment_steps"],
                            checkpoints=chain)
    return payload, receipt, store
