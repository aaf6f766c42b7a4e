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


def _accept_in_a_transaction(unit: WorkUnit, token, verify: bool) -> None:
    with transaction.atomic():
        jobs.unit_accept(unit_id=unit.pk, lease_token=token, result_sha256="0" * 64, samples=unit.samples,
                         metrics={}, verify=verify)


def _accept_together(unit: WorkUnit, token, verify: bool) -> None:
    """As a result is accepted (contributors.results): on PostgreSQL, the statistic added to in SQL and the
    deadlines moved after the commit (jobs.unit_accept_with)."""
    jobs.unit_accept_with(None, unit=unit, lease_token=token, result_sha256="0" * 64, samples=unit.samples,
                          metrics={}, verify=verify)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("accept", [_accept_in_a_transaction, _accept_together])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(speeds=st.lists(st.sampled_from([0.0, 5e3, 2e4, 1e5]), min_size=1, max_size=5), ops=st.lists(OPS, max_size=30))
def test_the_running_statistic_gives_the_deadlines_of_a_full_recompute(customer, settings, accept, speeds, ops):
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
                unit = WorkUnit.objects.select_related("round__job").get(pk=unit_id)
                try:
                    accept(unit, leased.pop(unit_id), op == "verify")
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
            seen = deadlines.Arrivals()
            for arrival in arrived:
                seen = seen.add(arrival)
            assert {int(bucket): n for bucket, n in kept.arrival_paces.items()} == dict(seen.paces)
            assert kept.latest_arrival_seconds == pytest.approx(seen.latest, abs=1e-5)
            assert (kept.deadline_at - kept.opened_at).total_seconds() == pytest.approx(
                _recomputed(kept, arrived, settings), abs=1e-5)
            assert (kept.close_at - kept.opened_at).total_seconds() == pytest.approx(
                2 * (kept.deadline_at - kept.opened_at).total_seconds(), abs=1e-5)
    finally:
        Job.objects.filter(pk=job.pk).delete()  # its open round must not hand units to the next example


@pytest.mark.django_db(transaction=True)
def test_an_acceptance_sent_together_adds_to_the_statistic_as_python_does(customer, settings):
    """jobs.unit_accept_with adds each arrival in SQL (PostgreSQL; unit_accept elsewhere): after results of several
    paces, arriving out of their plan's order, the round holds what deadlines.Arrivals.add gives."""
    settings.MUNINN_ROUND_DEADLINE_SECONDS = 10**7
    dataset = jobs.dataset_create(owner=customer, filename="digits.npz", data=digits_npz(400))
    job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams={"batch_size": 8}, rounds=1, seed=1)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    devices = [(9000 + i, speed) for i, speed in enumerate([0.0, 5e3, 2e4, 1e5, 2e4])]
    rnd = jobs.round_open(job_id=job.pk, devices=devices)
    leased = [jobs.unit_lease(device_id=device, resources=RESOURCES) for device, _ in devices * 2]
    leased = [unit for unit in leased if unit is not None]
    assert len(leased) >= 4  # the round's units (devices of one speed may share one)
    seen = deadlines.Arrivals()
    try:
        for unit, earlier in zip(leased, [30, 0, 200, 5, 90]):  # each time the round opened that much earlier
            Round.objects.filter(pk=rnd.pk).update(opened_at=F("opened_at") - timedelta(seconds=earlier),
                                                   deadline_at=F("deadline_at") - timedelta(seconds=earlier),
                                                   close_at=F("close_at") - timedelta(seconds=earlier))
            unit = WorkUnit.objects.select_related("round__job").get(pk=unit.pk)
            _accept_together(unit, unit.lease_token, verify=False)
            unit.refresh_from_db()
            seen = seen.add(deadlines.Arrival((unit.submitted_at - unit.round.opened_at).total_seconds(),
                                              unit.expected_seconds))
            kept = Round.objects.get(pk=rnd.pk)
            paces = {int(bucket): n for bucket, n in kept.arrival_paces.items()}
            assert (kept.arrivals, paces) == (seen.count, dict(seen.paces))
            assert kept.latest_arrival_seconds == pytest.approx(seen.latest, abs=1e-5)
            soft = deadlines.deadlines(plan=deadlines.Plan(kept.plan_seconds, kept.plan_complete), arrivals=seen,
                                       grace=settings.MUNINN_ROUND_GRACE_SECONDS,
                                       floor=settings.MUNINN_ROUND_DEADLINE_MIN_SECONDS,
                                       ceiling=settings.MUNINN_ROUND_DEADLINE_SECONDS).soft
            assert (kept.deadline_at - kept.opened_at).total_seconds() == pytest.approx(soft, abs=1e-5)
        assert seen.count == len(leased) and len(seen.paces) >= 2
    finally:
        Job.objects.filter(pk=job.pk).delete()
