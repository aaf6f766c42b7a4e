"""Opening a round for many devices: one unit and one shard blob per device, exactly the planned rows."""
import torch

from jobs import services as jobs
from jobs import storage
from jobs.models import Job, WorkUnit
from jobs.sharding import plan_shards

from .conftest import digits_npz


def _running_job(customer, **hparams) -> Job:
    dataset = jobs.dataset_create(owner=customer, filename="digits.npz", data=digits_npz())
    job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams=hparams, rounds=2, seed=3)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    return job


def test_round_open_gives_each_device_its_planned_shard_as_a_unit_with_its_own_blob(customer):
    job = _running_job(customer, batch_size=1)
    devices = [(1000 + i, float(1 + i % 7)) for i in range(300)]  # (device id, samples/s), unequal speeds

    rnd = jobs.round_open(job_id=job.pk, devices=devices)

    units = list(rnd.units.order_by("index"))
    planned = plan_shards(job.n_train, [speed for _, speed in devices], min_shard=1)
    assert len(units) == len(planned) == 300
    assert [(u.shard_start, u.shard_stop, u.preferred_device_id) for u in units] == [
        (s.start, s.stop, devices[s.device][0]) for s in planned]
    X, y = jobs.load_xy(job.train_sha256)
    for unit in units:
        shard_X, shard_y = jobs.load_xy(unit.shard_sha256)
        assert torch.equal(shard_X, X[unit.shard_start:unit.shard_stop])
        assert torch.equal(shard_y, y[unit.shard_start:unit.shard_stop])
    assert len({u.shard_sha256 for u in units}) == 300 and len({u.seed for u in units}) == 300
    assert all(u.status == WorkUnit.Status.QUEUED and u.reserved_until is not None for u in units)


def test_round_open_twice_returns_the_open_round_and_writes_nothing_more(customer):
    job = _running_job(customer, batch_size=1)
    devices = [(1, 10.0), (2, 30.0)]

    first = jobs.round_open(job_id=job.pk, devices=devices)
    again = jobs.round_open(job_id=job.pk, devices=devices + [(3, 20.0)])

    assert again.pk == first.pk
    assert WorkUnit.objects.filter(round__job=job).count() == 2


def test_blobs_put_returns_hashes_in_order_and_stores_identical_blobs_once(settings, tmp_path):
    blobs = [b"shard a", b"shard b", b"shard a", b"shard c"]

    shas = storage.blobs_put(blobs, threads=4)

    assert shas == [storage.sha256_hex(b) for b in blobs]
    assert [storage.blob_get(sha) for sha in shas] == blobs
    assert sorted(p.name for p in (tmp_path / "media" / "blobs").rglob("*") if p.is_file()) == sorted(set(shas))
