"""A round's deadlines are kept as a running statistic of its arrivals (one update per result, whatever the
round's size): after any sequence of leases, results (accepted at once or verified first), rejections,
re-issued stragglers and their backups, they are the deadlines computed afresh from every arrival."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobs import deadlines
from jobs import services as jobs
from jobs.models import Job, Round, WorkUnit
from muninn.errors import Conflict

from .conftest import digits_npz

RESOURCES = {"cpu": 2**40}
OPS = st.one_of(
    st.tuples(st.just("lease"), st.integers(0, 9)),
    st.tuples(st.just("accept"), st.integers(0, 9)),
    st.tuples(st.just("verify"), st.integers(0, 9)),
    st.tuples(st.just("verified"), st.integers(0, 9)),
    st.tuples(st.just("reject"), st.integers(0, 9)),
    st.tuples(st.just("reissue"), st.just(0)),
    st.tuples(st.just("wait"), st.integers(1, 600)),  # seconds pass: the round opened that much earlier
)


def _recomputed(rnd: Round, arrived: list[deadlines.Arrival], django_settings) -> float:
    plan = list(rnd.units.filter(backup_of__isnull=True).values_list("expected_seconds", flat=True))
    return deadlines.round_deadlines(outstanding=plan, arrivals=arrived,
                                     grace=django_settings.MUNINN_ROUND_GRACE_SECONDS,
                                     floor=django_settings.MUNINN_ROUND_DEADLINE_MIN_SECONDS,
                                     ceiling=django_settings.MUNINN_ROUND_DEADLINE_SECONDS).soft


@pytest.mark.django_db
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(speeds=st.lists(st.sampled_from([0.0, 5e3, 2e4, 1e5]), min_size=1, max_size=5), ops=st.lists(OPS, max_size=30))
def test_the_running_statistic_gives_the_deadlines_of_a_full_recompute(customer, settings, speeds, ops):
    settings.MUNINN_ROUND_DEADLINE_SECONDS = 10**7  # room for the arrivals' pace to show (no ceiling in the way)
    dataset = jobs.dataset_create(owner=customer, filename="digits.npz", data=digits_npz(400))
    job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams={"batch_size": 8}, rounds=1, seed=1)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    devices = [(9000 + i, speed) for i, speed in enumerate(speeds)]
    rnd = jobs.round_open(job_id=job.pk, devices=devices)
    leased: dict[int, object] = {}  # unit id → lease token
    verifying: list[int] = []
    arrived: list[deadlines.Arrival] = []  # every result that came in: (seconds after opening, planned seconds)
    try:
        for op, n in ops:
            before = Round.objects.get(pk=rnd.pk)
            if op == "lease":
                unit = jobs.unit_lease(device_id=devices[n % len(devices)][0], resources=RESOURCES)
                if unit is not None:
                    leased[unit.pk] = unit.lease_token
            elif op in ("accept", "verify") and leased:
                unit_id = sorted(leased)[n % len(leased)]
                unit = WorkUnit.objects.get(pk=unit_id)
                try:
                    with transaction.atomic():
                        jobs.unit_accept(unit_id=unit_id, lease_token=leased.pop(unit_id), result_sha256="0" * 64,
                                         samples=unit.samples, metrics={}, verify=op == "verify")
                except Conflict:
                    continue  # its shard's other copy was accepted first
                unit.refresh_from_db()
                arrived.append(deadlines.Arrival((unit.submitted_at - before.opened_at).total_seconds(),
                                                 unit.expected_seconds))
                if op == "verify":
                    verifying.append(unit_id)
            elif op in ("verified", "reject") and verifying:
                unit_id = verifying.pop(n % len(verifying))
                with transaction.atomic():
                    if op == "verified":
                        try:
                            jobs.unit_verified(unit_id=unit_id)
                        except Conflict:
                            pass
                    else:
                        jobs.unit_reject(unit_id=unit_id)
            elif op == "reissue":
                jobs.units_reissue_stragglers(now=timezone.now() + timedelta(days=365))
            elif op == "wait":
                Round.objects.filter(pk=rnd.pk).update(opened_at=F("opened_at") - timedelta(seconds=n),
                                                       deadline_at=F("deadline_at") - timedelta(seconds=n),
                                                       close_at=F("close_at") - timedelta(seconds=n))
            kept = Round.objects.get(pk=rnd.pk)
            assert kept.arrivals == len(arrived)
            assert (kept.deadline_at - kept.opened_at).total_seconds() == pytest.approx(
                _recomputed(kept, arrived, settings), abs=1e-5)
            assert (kept.close_at - kept.opened_at).total_seconds() == pytest.approx(
                2 * (kept.deadline_at - kept.opened_at).total_seconds(), abs=1e-5)
    finally:
        Job.objects.filter(pk=job.pk).delete()  # its open round must not hand units to the next example
