"""Scheduling: capability routing, adaptive deadlines, stragglers re-issued (first valid result wins), and a
job that no online device can run telling its customer so."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from hypothesis import given
from hypothesis import strategies as st

from billing import selectors as ledger
from billing.models import Transaction
from contributors.models import Device, Receipt
from jobs import services as jobs
from jobs.deadlines import PACE_ERROR, Arrival, Arrivals, expected_seconds, round_deadlines
from jobs.models import Job, Round, WorkUnit

from .test_spine import assert_ledger_consistent, create_job

pytestmark = pytest.mark.django_db(transaction=True)
GIB = 2**30
LIMITS = {"grace": 5.0, "floor": 10.0, "ceiling": 900.0}


# --- Deadlines: pure arithmetic ---------------------------------------------------------------------

def test_before_any_arrival_the_plan_gets_generous_slack():
    soft, hard = round_deadlines(outstanding=[20.0, 30.0], arrivals=[], **LIMITS)
    assert soft == 30.0 * 3 + 5 and hard == 2 * soft


def test_without_a_plan_the_deadline_is_the_ceiling():
    assert round_deadlines(outstanding=[0.0], arrivals=[], **LIMITS).soft == 900.0
    assert round_deadlines(outstanding=[20.0, 0.0], arrivals=[], **LIMITS).soft == 900.0  # one unknown device


def test_arrivals_set_the_pace_of_the_outstanding_units():
    # The plan said 10 s; the first result took 40 s: the devices are 4× slower than their probes said.
    slow = round_deadlines(outstanding=[10.0], arrivals=[Arrival(40.0, 10.0)], **LIMITS)
    assert slow.soft == pytest.approx(40.0 * 1.5 + 5, rel=PACE_ERROR)
    # The plan said 100 s; the first result took 20 s: the deadline comes in, well before the plan's.
    fast = round_deadlines(outstanding=[100.0], arrivals=[Arrival(20.0, 100.0)], **LIMITS)
    assert fast.soft == pytest.approx(20.0 * 1.5 + 5)
    assert fast.soft < round_deadlines(outstanding=[100.0], arrivals=[], **LIMITS).soft


def test_the_pace_is_the_median_so_one_odd_arrival_does_not_move_it():
    arrivals = [Arrival(10.0, 10.0), Arrival(11.0, 10.0), Arrival(90.0, 10.0)]
    assert round_deadlines(outstanding=[10.0], arrivals=arrivals, **LIMITS).soft == pytest.approx(90 * 1.5 + 5)
    # ...the latest arrival still bounds it below: the round is at least that slow. Without it:
    arrivals = [Arrival(10.0, 10.0), Arrival(11.0, 10.0), Arrival(12.0, 10.0)]
    assert round_deadlines(outstanding=[20.0], arrivals=arrivals, **LIMITS).soft == pytest.approx(
        20 * 1.1 * 1.5 + 5, rel=PACE_ERROR)


def test_the_slowest_planned_unit_sets_the_prediction_even_once_it_has_arrived():
    # Units planned at 10 s and 40 s; the 40 s one came in first, on plan: the round still expects 40 s.
    arrivals = [Arrival(40.0, 40.0)]
    assert round_deadlines(outstanding=[10.0], arrivals=arrivals, **LIMITS).soft == pytest.approx(
        40 * 1.5 + 5, rel=PACE_ERROR)


@given(st.lists(st.tuples(st.floats(0.0, 1e5), st.sampled_from([0.0, 0.5, 3.0, 120.0])), max_size=40),
       st.randoms(use_true_random=False))
def test_arrivals_kept_one_at_a_time_in_any_order_are_the_same_statistic(pairs, rng):
    arrivals = [Arrival(elapsed, expected) for elapsed, expected in pairs]
    shuffled = arrivals[:]
    rng.shuffle(shuffled)

    kept = Arrivals()
    for arrival in shuffled:
        kept = kept.add(arrival)

    assert kept.count == len(arrivals)
    assert kept.latest == max((a.elapsed for a in arrivals), default=0.0)
    assert sum(kept.paces.values()) == sum(a.expected > 0 for a in arrivals)
    assert round_deadlines(outstanding=[7.0], arrivals=shuffled, **LIMITS) == round_deadlines(
        outstanding=[7.0], arrivals=arrivals, **LIMITS)


@given(st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=60))
def test_the_kept_median_pace_is_the_exact_median_to_within_its_bucket(paces):
    kept = Arrivals()
    for pace in paces:
        kept = kept.add(Arrival(pace * 10.0, 10.0))

    exact = sorted(paces)[(len(paces) - 1) // 2]  # the lower middle one of an even count
    assert kept.median_pace() == pytest.approx(exact, rel=PACE_ERROR * 1.0001)


def test_deadlines_stay_within_floor_and_ceiling():
    assert round_deadlines(outstanding=[0.1], arrivals=[Arrival(0.2, 0.1)], **LIMITS).soft == 10.0
    assert round_deadlines(outstanding=[1e6], arrivals=[], **LIMITS).soft == 900.0


def test_expected_seconds_is_flops_over_speed():
    assert expected_seconds(10**9, 2e8) == 5.0
    assert expected_seconds(10**9, 0.0) == 0.0


# --- Routing by backend and memory ------------------------------------------------------------------

def set_resources(device: Device, *, ram: int, gpu: int = 0) -> None:
    device.memory_bytes, device.gpu_memory_bytes = ram, gpu
    device.capabilities = {**device.capabilities, "backends": ["cpu", "cuda"] if gpu else ["cpu"],
                           "gpus": [{"name": "GPU", "memory_bytes": gpu}] if gpu else []}
    device.save()


def test_cpu_units_need_the_memory_in_ram_not_on_the_gpu(customer_api, digits_dataset, make_device):
    big_gpu_small_ram, roomy = make_device("gpu-box"), make_device("roomy")
    job = create_job(customer_api, digits_dataset["id"], rounds=1, start=False)
    Job.objects.filter(pk=job["id"]).update(peak_memory_bytes=4 * GIB)
    set_resources(big_gpu_small_ram.device, ram=2 * GIB, gpu=80 * GIB)
    set_resources(roomy.device, ram=16 * GIB)
    jobs.job_start(job_id=job["id"])

    assert Job.objects.get(pk=job["id"]).backends == "cpu"
    assert WorkUnit.objects.filter(round__job_id=job["id"]).exists()
    assert WorkUnit.objects.get(round__job_id=job["id"]).preferred_device_id == roomy.device.pk
    assert big_gpu_small_ram.claim() is None
    assert roomy.claim() is not None


def test_a_job_no_online_device_can_run_says_so_then_runs_when_one_comes(customer_api, digits_dataset, make_device):
    small = make_device("small")
    set_resources(small.device, ram=1 * GIB)
    job = create_job(customer_api, digits_dataset["id"], rounds=1, start=False)
    Job.objects.filter(pk=job["id"]).update(peak_memory_bytes=3 * GIB)
    jobs.job_start(job_id=job["id"])

    waiting = customer_api.get(f"/api/jobs/{job['id']}").json()["waiting"]
    assert "3.00 GiB of memory on a CPU" in waiting and "offers 1.00 GiB" in waiting
    assert small.claim() is None

    big = make_device("big")
    set_resources(big.device, ram=8 * GIB)
    assert customer_api.get(f"/api/jobs/{job['id']}").json()["waiting"] is None
    big.work_one()
    assert Job.objects.get(pk=job["id"]).status == Job.Status.SUCCEEDED


def test_a_cuda_job_with_no_gpu_online_says_which_backend_is_missing(customer_api, digits_dataset, make_device):
    make_device("laptop")
    job = create_job(customer_api, digits_dataset["id"], rounds=1, start=False)
    Job.objects.filter(pk=job["id"]).update(backends="cuda")
    jobs.job_start(job_id=job["id"])

    waiting = customer_api.get(f"/api/jobs/{job['id']}").json()["waiting"]
    assert "none of the 1 device(s) online has a CUDA GPU" in waiting


# --- Deadlines in a live round ----------------------------------------------------------------------

def test_round_deadlines_come_from_the_plan_then_move_with_arrivals(customer_api, digits_dataset, make_device,
                                                                   settings):
    a, b = make_device("a"), make_device("b")
    Device.objects.filter(pk=a.device.pk).update(flops_per_s=1e12)  # the probe flattered it: 1 TFLOP/s
    Device.objects.filter(pk=b.device.pk).update(flops_per_s=1e12)
    job = create_job(customer_api, digits_dataset["id"], rounds=1)
    rnd = Round.objects.get(job_id=job["id"])
    units = list(rnd.units.all())
    assert all(u.expected_seconds > 0 for u in units)
    planned = (rnd.deadline_at - rnd.opened_at).total_seconds()
    assert planned == pytest.approx(settings.MUNINN_ROUND_DEADLINE_MIN_SECONDS)  # tiny units: the floor
    assert (rnd.close_at - rnd.opened_at).total_seconds() == pytest.approx(2 * planned)

    # The first result arrives 60 s after the opening: far slower than planned, so the deadline moves out.
    Round.objects.filter(pk=rnd.pk).update(opened_at=rnd.opened_at - timedelta(seconds=60))
    a.work_one()
    rnd.refresh_from_db()
    assert (rnd.deadline_at - rnd.opened_at).total_seconds() >= 60 * 1.5


def test_a_straggler_is_reissued_and_the_first_valid_result_wins(customer_api, digits_dataset, make_device):
    fast, slow = make_device("fast"), make_device("slow")
    job = create_job(customer_api, digits_dataset["id"], rounds=1)
    rnd = Round.objects.get(job_id=job["id"])
    assert rnd.units.count() == 2

    fast.work_one()
    straggling = slow.claim()
    weights, receipt = slow.train(straggling)  # ...finished, but far too late:

    backups = jobs.units_reissue_stragglers(now=timezone.now() + timedelta(hours=1))
    assert len(backups) == 1 and WorkUnit.objects.get(pk=backups[0]).backup_of_id == straggling["id"]
    assert jobs.units_reissue_stragglers(now=timezone.now() + timedelta(hours=1)) == []  # once per unit
    assert slow.claim() is None  # never its own backup
    claimed = fast.claim()
    assert claimed["id"] == backups[0]
    assert fast.submit(backups[0], *fast.train(claimed)).status_code == 201

    late = slow.submit(straggling["id"], weights, receipt)
    assert late.status_code == 409 and late.json()["error"]["code"] == "unit_cancelled"
    done = Job.objects.get(pk=job["id"])
    assert done.status == Job.Status.SUCCEEDED
    assert WorkUnit.objects.get(pk=straggling["id"]).status == WorkUnit.Status.CANCELLED
    assert Round.objects.get(pk=rnd.pk).metrics["samples"] == done.n_train  # every sample, once
    assert_ledger_consistent(done)
    assert Transaction.objects.filter(kind=Transaction.Kind.CHARGE, job=done).count() == 2  # two shards
    money = ledger.job_money(job=done)
    assert money["quoted"] - 1 <= money["charged"] <= money["quoted"]
    assert not Receipt.objects.filter(device=slow.device).exists()


def test_when_both_copies_are_being_verified_the_first_verified_wins(customer_api, digits_dataset, make_device,
                                                                     monkeypatch):
    from contributors import tasks, verification

    a, b = make_device("a"), make_device("b")
    job = create_job(customer_api, digits_dataset["id"], rounds=1)
    a.work_one()
    original = b.claim()
    backup_id = jobs.units_reissue_stragglers(now=timezone.now() + timedelta(hours=1))[0]
    claimed = a.claim()
    assert claimed["id"] == backup_id
    backup = a.train(claimed)
    mine = b.train(original)
    held = []
    monkeypatch.setattr(tasks.verify_unit, "delay", held.append)  # hold both re-executions back
    assert a.submit(backup_id, *backup).status_code == 201
    assert b.submit(original["id"], *mine).status_code == 201
    assert held == [backup_id, original["id"]]
    assert set(WorkUnit.objects.filter(pk__in=[backup_id, original["id"]]).values_list("status", flat=True)) == {
        WorkUnit.Status.VERIFYING}

    verification.unit_verify(unit_id=backup_id)  # checks the original too: it waits in the same round
    verification.unit_verify(unit_id=original["id"])  # nothing left to check
    loser = Receipt.objects.get(unit_id=original["id"])

    assert loser.status == Receipt.Status.REJECTED and loser.reason.startswith("superseded")
    assert Device.objects.get(pk=b.device.pk).failures == 0  # late is not wrong
    assert WorkUnit.objects.get(pk=original["id"]).status == WorkUnit.Status.CANCELLED
    done = Job.objects.get(pk=job["id"])
    assert done.status == Job.Status.SUCCEEDED
    assert_ledger_consistent(done)


def test_past_the_hard_deadline_a_round_closes_with_its_verified_updates(customer_api, digits_dataset, make_device):
    from jobs import tasks

    a, b = make_device("a"), make_device("b")
    job = create_job(customer_api, digits_dataset["id"], rounds=2)
    a.work_one()
    b.claim()  # and never comes back
    rnd = Round.objects.get(job_id=job["id"], number=1)
    assert jobs.rounds_overdue() == []
    Round.objects.filter(pk=rnd.pk).update(deadline_at=timezone.now() - timedelta(seconds=2),
                                           close_at=timezone.now() - timedelta(seconds=1))

    tasks.close_overdue_rounds()

    rnd.refresh_from_db()
    assert rnd.status == Round.Status.CLOSED and rnd.metrics["units"] == 1
    assert Job.objects.get(pk=job["id"]).current_round == 2


def test_a_round_with_no_verified_update_never_closes(customer_api, digits_dataset, make_device):
    a = make_device("a")
    job = create_job(customer_api, digits_dataset["id"], rounds=1)
    a.claim()
    Round.objects.filter(job_id=job["id"]).update(deadline_at=timezone.now() - timedelta(hours=2),
                                                  close_at=timezone.now() - timedelta(hours=1))
    assert jobs.rounds_overdue() == []


def test_a_round_past_its_hard_deadline_waits_for_results_being_reexecuted(customer_api, digits_dataset,
                                                                         make_device, monkeypatch):
    from contributors import tasks

    a, b = make_device("a"), make_device("b")
    job = create_job(customer_api, digits_dataset["id"], rounds=1)
    a.work_one()
    monkeypatch.setattr(tasks.verify_unit, "delay", lambda unit_id: None)  # b's re-execution is slow
    b.work_one()
    Round.objects.filter(job_id=job["id"]).update(deadline_at=timezone.now() - timedelta(seconds=2),
                                                  close_at=timezone.now() - timedelta(seconds=1))
    assert WorkUnit.objects.filter(round__job_id=job["id"], status=WorkUnit.Status.VERIFYING).count() == 1
    assert jobs.rounds_overdue() == []



def test_a_new_device_is_planned_at_the_measured_median_not_at_its_probes_guess(make_device):
    from contributors.selectors import device_capacities_online

    veterans = [make_device(f"v{i}") for i in range(3)]
    for device, speed in zip(veterans, (1e9, 2e9, 4e9)):
        Device.objects.filter(pk=device.device.pk).update(verified_total=5, flops_per_s=speed)
    newcomer = make_device("new")
    Device.objects.filter(pk=newcomer.device.pk).update(flops_per_s=1e6)  # its probe ran on a busy machine

    speeds = dict(device_capacities_online(min_memory_bytes=0, backends=["cpu"]))
    assert speeds[newcomer.device.pk] == 2e9
    assert [speeds[v.device.pk] for v in veterans] == [1e9, 2e9, 4e9]
    Device.objects.exclude(pk=newcomer.device.pk).delete()
    assert device_capacities_online(min_memory_bytes=0, backends=["cpu"]) == [(newcomer.device.pk, 1e6)]
