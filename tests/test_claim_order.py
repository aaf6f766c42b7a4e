"""Which queued unit a claim leases: the device's own shard first, else one nobody reserved, else one whose
reservation for another device has run out, the oldest reservation first."""
from datetime import timedelta

from django.utils import timezone

from jobs import services as jobs
from jobs.models import Job, WorkUnit

from .conftest import digits_npz

MEMORY = 2**40


def _round_for_three_devices(customer) -> list[WorkUnit]:
    dataset = jobs.dataset_create(owner=customer, filename="digits.npz", data=digits_npz())
    job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams={"batch_size": 1}, rounds=1, seed=5)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    rnd = jobs.round_open(job_id=job.pk, devices=[(1, 10.0), (2, 10.0), (3, 10.0)])
    return list(rnd.units.order_by("index"))  # reserved for devices 1, 2 and 3


def test_a_device_gets_its_own_shard_before_an_older_unit_open_to_anyone(customer):
    units = _round_for_three_devices(customer)
    WorkUnit.objects.filter(pk=units[0].pk).update(preferred_device_id=None, reserved_until=None)

    leased = jobs.unit_lease(device_id=3, resources={"cpu": MEMORY})

    assert leased.pk == units[2].pk and leased.status == WorkUnit.Status.LEASED


def test_a_device_without_a_shard_gets_open_units_but_never_another_devices_reserved_one(customer):
    units = _round_for_three_devices(customer)
    WorkUnit.objects.filter(pk=units[0].pk).update(preferred_device_id=None, reserved_until=None)

    first = jobs.unit_lease(device_id=4, resources={"cpu": MEMORY})
    second = jobs.unit_lease(device_id=4, resources={"cpu": MEMORY})

    assert first.pk == units[0].pk
    assert second is None  # units 1 and 2 are reserved for devices 2 and 3


def test_a_reservation_that_has_passed_opens_the_unit_to_anyone(customer):
    units = _round_for_three_devices(customer)
    WorkUnit.objects.filter(pk=units[1].pk).update(reserved_until=timezone.now() - timedelta(seconds=1))

    leased = jobs.unit_lease(device_id=4, resources={"cpu": MEMORY})

    assert leased.pk == units[1].pk


def test_a_unit_nobody_reserved_goes_first_then_the_reservations_that_ran_out_oldest_first(customer):
    units = _round_for_three_devices(customer)
    now = timezone.now()
    WorkUnit.objects.filter(pk=units[0].pk).update(reserved_until=now - timedelta(seconds=1))
    WorkUnit.objects.filter(pk=units[1].pk).update(reserved_until=now - timedelta(seconds=30))
    WorkUnit.objects.filter(pk=units[2].pk).update(preferred_device_id=None, reserved_until=None)

    leased = [jobs.unit_lease(device_id=4, resources={"cpu": MEMORY}, max_held=3) for _ in range(4)]

    assert [u.pk for u in leased[:3]] == [units[2].pk, units[1].pk, units[0].pk] and leased[3] is None
