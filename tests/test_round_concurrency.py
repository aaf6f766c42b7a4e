"""Results of one round on PostgreSQL, at once: two copies of one shard (a straggler and its backup) are never both
accepted, and a result that comes during an aggregation waits for it and finds the round closed."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from jobs import services as jobs
from jobs.models import Job, Round, WorkUnit
from jobs.services import rounds
from muninn.errors import Conflict

from .conftest import digits_npz

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]
RESOURCES = {"cpu": 2**40}


@pytest.fixture(autouse=True)
def _postgres():
    if connection.vendor != "postgresql":
        pytest.fail("this test needs PostgreSQL: run it through `make test` (DATABASE_URL=postgres://...)")


def open_round(customer, devices: int, seed: int = 1) -> tuple[Round, dict[int, object]]:
    """A running job's round with one unit per device, each leased to its device: (round, {unit id: lease token})."""
    dataset = jobs.dataset_create(owner=customer, filename="digits.npz", data=digits_npz(400))
    job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams={"batch_size": 8}, rounds=1,
                          seed=seed)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    rnd = jobs.round_open(job_id=job.pk, devices=[(9000 + i, 1e5) for i in range(devices)])
    leased = {}
    for i in range(devices):
        unit = jobs.unit_lease(device_id=9000 + i, resources=RESOURCES)
        leased[unit.pk] = unit.lease_token
    return rnd, leased


def accept(unit_id: int, token) -> None:
    with transaction.atomic():
        jobs.unit_accept(unit_id=unit_id, lease_token=token, result_sha256="0" * 64, samples=1, metrics={})


def waiting_for_a_lock(n: int, timeout: float = 10) -> None:
    """Until n other sessions of this database wait for a lock (PostgreSQL's own view of its sessions)."""
    deadline = timezone.now() + timedelta(seconds=timeout)
    with connection.cursor() as cursor:
        while timezone.now() < deadline:
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND wait_event_type = 'Lock'")
            if cursor.fetchone()[0] >= n:
                return
            time.sleep(0.01)
    raise AssertionError(f"{n} session(s) never waited for a lock")


def together(*calls) -> list[BaseException | None]:
    """Run the calls in threads released at one moment; each one's exception (or None)."""
    barrier = threading.Barrier(len(calls))
    outcome: list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            barrier.wait()
            calls[i]()
        except BaseException as e:  # noqa: BLE001  (returned)
            outcome[i] = e
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a result never finished (a lock waited on forever)"
    return outcome


def test_a_straggler_and_its_backup_arriving_together_are_accepted_once(customer):
    rnd, leased = open_round(customer, 8)
    backups = jobs.units_reissue_stragglers(now=timezone.now() + timedelta(days=1))
    assert len(backups) == 8
    backup_tokens = {}
    for i in range(8):  # free devices take the backups
        unit = jobs.unit_lease(device_id=9100 + i, resources=RESOURCES)
        backup_tokens[unit.pk] = unit.lease_token
    assert set(backup_tokens) == set(backups)

    for backup in WorkUnit.objects.filter(pk__in=backups):
        original = backup.backup_of_id
        outcome = together(lambda: accept(original, leased[original]),
                           lambda: accept(backup.pk, backup_tokens[backup.pk]))
        refused = [e for e in outcome if e is not None]
        assert len(refused) == 1 and isinstance(refused[0], Conflict) and refused[0].code == "superseded", outcome
        statuses = sorted(WorkUnit.objects.filter(pk__in=[original, backup.pk]).values_list("status", flat=True))
        assert statuses == [WorkUnit.Status.ACCEPTED, WorkUnit.Status.CANCELLED]

    assert Round.objects.get(pk=rnd.pk).arrivals == 8  # one per shard: each refused copy was rolled back whole


def test_a_result_during_an_aggregation_waits_for_it_and_finds_the_round_closed(customer):
    rnd, leased = open_round(customer, 1)
    [(unit_id, token)] = leased.items()
    locked = threading.Event()
    order: list[str] = []

    def aggregation() -> None:
        with transaction.atomic():
            rounds.round_locked(rnd.pk)  # as round_aggregate (and a verdict, and a straggler's backup) hold it
            locked.set()
            waiting_for_a_lock(1)  # the result waits here
            Round.objects.filter(pk=rnd.pk).update(status=Round.Status.CLOSED, closed_at=timezone.now())
            order.append("closed")

    def result() -> None:
        locked.wait(timeout=10)
        try:
            accept(unit_id, token)
        finally:
            order.append("answered")

    outcome = together(aggregation, result)
    assert outcome[0] is None and isinstance(outcome[1], Conflict) and outcome[1].code == "lease_lost", outcome
    assert order == ["closed", "answered"]
    assert WorkUnit.objects.get(pk=unit_id).status == WorkUnit.Status.LEASED  # nothing of the result was kept
