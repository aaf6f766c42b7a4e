"""Concurrent claims on PostgreSQL: row locks with SKIP LOCKED never lease one unit twice."""
from __future__ import annotations

import threading

import pytest
from django.db import connection

from contributors import services as contributors
from contributors.models import Lease
from jobs import services as jobs
from jobs.models import WorkUnit

from .conftest import digits_npz, register_device

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]
DEVICES = 40
THREADS = 16


def test_concurrent_claims_never_lease_a_unit_twice(customer, contributor, settings):
    if connection.vendor != "postgresql":
        pytest.fail("this test needs PostgreSQL: run it through `make test` (DATABASE_URL=postgres://...)")
    settings.MUNINN_MAX_DEVICES_PER_ACCOUNT = DEVICES
    devices = [register_device(contributor, f"d{i}") for i in range(DEVICES)]
    dataset = jobs.dataset_create(owner=customer, filename="digits.npz", data=digits_npz())
    job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams={}, rounds=1, seed=1)
    jobs.job_start(job_id=job.pk)  # opens round 1 with one shard per online device
    units = WorkUnit.objects.filter(round__job=job).count()
    assert units == DEVICES

    claimed: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(THREADS)
    lock = threading.Lock()

    def claim_until_empty(my_devices):
        try:
            barrier.wait()
            while True:
                got = [contributors.unit_claim(device=d) for d in my_devices]
                got = [c.unit.pk for c in got if c is not None]
                if not got:
                    return
                with lock:
                    claimed.extend(got)
        except BaseException as e:  # noqa: BLE001  (surfaced below)
            errors.append(e)
        finally:
            connection.close()

    threads = [threading.Thread(target=claim_until_empty, args=(devices[i::THREADS],)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert not errors, errors
    assert sorted(claimed) == sorted(set(claimed))
    assert len(claimed) == units
    assert Lease.objects.count() == units
    assert WorkUnit.objects.filter(round__job=job, status=WorkUnit.Status.LEASED).count() == units


def test_the_hot_paths_statements_are_prepared_once_per_connection(customer, contributor):
    """The worker API's fixed SQL (muninn/sql.py) is prepared on PostgreSQL: a second device's claim runs the
    statements the first one prepared on this connection (each text prepared once), on the plan made the first time
    (PostgreSQL's generic plan: planning a claim cost more of its CPU than running it), and leases another unit."""
    if connection.vendor != "postgresql":
        pytest.fail("this test needs PostgreSQL: run it through `make test` (DATABASE_URL=postgres://...)")
    devices = [register_device(contributor, f"d{i}") for i in range(3)]
    dataset = jobs.dataset_create(owner=customer, filename="digits.npz", data=digits_npz())
    job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams={}, rounds=1, seed=1)
    jobs.job_start(job_id=job.pk)

    claims = [contributors.unit_claim(device=d) for d in devices]

    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements")
        prepared = cursor.fetchall()
    assert len({c.unit.pk for c in claims}) == 3 and all(c.lease.device_id == d.pk for c, d in zip(claims, devices))
    texts = [text for text, _, _ in prepared]
    assert len(texts) == len(set(texts)), "a statement was prepared twice on one connection"
    [(generic, custom)] = [(g, c) for text, g, c in prepared if text.startswith("UPDATE") and "SKIP LOCKED" in text]
    assert generic >= 3  # one lease statement, run by every claim on the plan made once (not planned per claim)
    assert all("$1" in text for text in texts)  # bound by the server
    assert not any(custom for _, _, custom in prepared)


def test_a_round_that_outgrows_the_units_statistics_refreshes_them(
        customer, contributor, monkeypatch):
    """Claims run on a plan made once per connection. Made while a new site's units' table was empty, it scans the
    table whole; a round adding more units than the statistics count refreshes them (ANALYZE, which has PostgreSQL
    make every connection's plans anew). A round the statistics already cover changes nothing."""
    if connection.vendor != "postgresql":
        pytest.fail("this test needs PostgreSQL: run it through `make test` (DATABASE_URL=postgres://...)")
    from jobs.services import rounds

    monkeypatch.setattr(rounds, "STATISTICS_REFRESH_UNITS", 3)
    devices = [register_device(contributor, f"d{i}") for i in range(8)]
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs_workunit")  # the statistics of an empty table, as on a new site
    assert _units_counted() <= 0
    dataset = jobs.dataset_create(owner=customer, filename="digits.npz", data=digits_npz())
    job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams={}, rounds=2, seed=1)
    jobs.job_start(job_id=job.pk)  # its task opens round 1, one unit per device

    units = WorkUnit.objects.filter(round__job=job).count()
    assert units == len(devices)
    assert _units_counted() == units  # refreshed: the statistics count the round's units
    assert not jobs.units_statistics_refresh(added=units)  # covered now: nothing runs
    assert jobs.units_statistics_refresh(added=units + 1)
    claim = contributors.unit_claim(device=devices[0])
    assert claim.unit.round.job_id == job.pk


def _units_counted() -> float:
    with connection.cursor() as cursor:
        cursor.execute("SELECT reltuples FROM pg_class WHERE oid = 'jobs_workunit'::regclass")
        return cursor.fetchone()[0]


def test_a_claim_probes_a_backups_original_by_its_id_and_never_scans_the_units(customer, contributor):
    """The claim's plans for any device (the ones kept per connection) never scan the units: "not the backup of a
    unit this device runs" is one probe of the original's row (written as NOT EXISTS, its plan hashed the whole
    units' table on the first backup it met), and the passes for units nobody reserved and for reservations that
    ran out each walk an index of only those (as one pass in id order, a device with no shard of its own walked
    every queued unit reserved for others before its 204)."""
    if connection.vendor != "postgresql":
        pytest.fail("this test needs PostgreSQL: run it through `make test` (DATABASE_URL=postgres://...)")
    import uuid

    from django.utils import timezone

    from jobs.services import leases

    device = register_device(contributor, "d")
    now = timezone.now()
    values = {"device": device.pk, "now": now, "expires": now, "max_held": 2, "token": uuid.uuid4(),
              "refused_after": now, "memory_cpu": 2**33}
    plans = []
    for number in range(len(leases._PASSES)):
        numbered, names = _numbered(leases._lease_sql("postgresql", ("cpu",), number, False, None))
        with connection.cursor() as cursor:
            cursor.execute(f"PREPARE claim_plan AS {numbered}")
            cursor.execute("SET plan_cache_mode = force_generic_plan")
            cursor.execute(f"EXPLAIN EXECUTE claim_plan({', '.join(['%s'] * len(names))})",
                           [values[n] for n in names])
            plan = "\n".join(row[0] for row in cursor.fetchall())
            cursor.execute("DEALLOCATE claim_plan")
        assert "Custom" not in plan and "SubPlan" in plan, plan
        assert "hashed SubPlan" not in plan and "Seq Scan on jobs_workunit o" not in plan, plan
        plans.append(plan)
    # the last two passes each walk an index that holds only their candidates, so a device with no shard of its own
    # finds out at once that every queued unit is reserved for another device
    assert "unit_queued_preferred" in plans[2] and "preferred_device_id IS NULL" in plans[2], plans[2]
    assert "unit_queued_reserved" in plans[3], plans[3]


def _numbered(statement: str) -> tuple[str, list[str]]:
    """A statement with %(name)s parameters as PREPARE takes it ($1, $2, ...), and the names in that order."""
    import re

    names: list[str] = []

    def number(match) -> str:
        if match[1] not in names:
            names.append(match[1])
        return f"${names.index(match[1]) + 1}"

    return re.sub(r"%\((\w+)\)s", number, statement).replace("%%", "%"), names


def test_prepared_statements_read_timestamps_as_the_orm_does_with_the_compiled_loader(customer, contributor):
    """muninn/sql.py puts psycopg's compiled timestamp loader on its cursor (Django's is pure Python): the values and
    their tzinfo are the ORM's own."""
    from datetime import timezone

    from muninn import sql
    from psycopg.types.datetime import TimestamptzLoader

    from contributors.models import Device

    if connection.vendor != "postgresql":
        pytest.fail("this test needs PostgreSQL: run it through `make test` (DATABASE_URL=postgres://...)")
    device = register_device(contributor)
    Device.objects.filter(pk=device.pk).update(last_seen_at="2026-11-28T16:39:49.123456+00:00")
    orm = Device.objects.values_list("created_at", "last_seen_at", "quarantined_at").get(pk=device.pk)

    read = sql.fetch_one(f"SELECT created_at, last_seen_at, quarantined_at FROM {sql.table(Device)} WHERE id = %s",
                         [device.pk])

    assert read == orm and read[2] is None
    assert all(value.tzinfo is timezone.utc for value in read[:2])
    loader = connection._muninn_prepared.adapters.get_loader(1184, 0)  # timestamptz, text
    assert loader.__module__.startswith("psycopg_binary") and loader is not TimestamptzLoader
