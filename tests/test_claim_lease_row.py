"""A claim writes the unit's lease and then its Lease row, two statements committed one by one
(contributors.services.unit_claim; the fault suite kills the web between them)."""
import pytest
from django.db import OperationalError

from contributors import services as contributors
from contributors.models import Lease
from jobs import services as jobs
from jobs.models import Job, WorkUnit
from muninn import sql

from .conftest import digits_npz, register_device

pytestmark = pytest.mark.django_db(transaction=True)


def _one_unit_for(customer, device) -> WorkUnit:
    dataset = jobs.dataset_create(owner=customer, filename="digits.npz", data=digits_npz())
    job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams={"batch_size": 1}, rounds=1, seed=5)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    return jobs.round_open(job_id=job.pk, devices=[(device.pk, 10.0)]).units.get()


def test_a_claim_leases_the_unit_and_writes_its_lease_row(customer, contributor):
    device = register_device(contributor)
    unit = _one_unit_for(customer, device)

    claim = contributors.unit_claim(device=device)

    unit.refresh_from_db()
    assert claim.unit.pk == unit.pk and unit.status == WorkUnit.Status.LEASED and unit.leased_device_id == device.pk
    assert Lease.objects.get(unit=unit, device=device, token=unit.lease_token).pk == claim.lease.pk


def test_a_lease_row_that_cannot_be_written_gives_the_unit_back_at_once(customer, contributor, monkeypatch):
    device = register_device(contributor)
    unit = _one_unit_for(customer, device)
    insert = sql.insert

    def failing(obj, **options):
        if isinstance(obj, Lease):
            raise OperationalError("the database went away")
        return insert(obj, **options)

    monkeypatch.setattr(sql, "insert", failing)
    with pytest.raises(OperationalError):
        contributors.unit_claim(device=device)

    unit.refresh_from_db()
    assert unit.status == WorkUnit.Status.QUEUED and unit.lease_token is None and not Lease.objects.exists()
    monkeypatch.setattr(sql, "insert", insert)
    assert contributors.unit_claim(device=device).unit.pk == unit.pk  # and it can be claimed again
