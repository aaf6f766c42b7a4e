"""Opening a round for many devices: one unit per device, exactly the planned rows, and the round's shards in one
blob (its pack), each unit's shard at its offset there."""
import io
import itertools
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from django.core.files.storage import default_storage
from sklearn.datasets import load_digits

from jobs import deadlines, shards, storage
from jobs import services as jobs
from jobs.models import Job, WorkUnit
from muninn_worker.federated.sharding import plan_shards
from muninn_worker.tensors import shard_to_bytes

from .conftest import digits_npz


def _running_job(customer, **hparams) -> Job:
    dataset = jobs.dataset_create(owner=customer, filename="digits.npz", data=digits_npz())
    job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams=hparams, rounds=2, seed=3)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    return job


def test_round_open_gives_each_device_its_planned_shard_as_a_unit_cut_from_one_pack(customer, settings):
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
        shard = jobs.unit_shard_bytes(unit, key=None)
        assert shard == shard_to_bytes(X[unit.shard_start:unit.shard_stop], y[unit.shard_start:unit.shard_stop])
        assert storage.sha256_hex(shard) == unit.shard_sha256  # what the device checks its download against
        shard_X, shard_y = jobs.unit_shard_xy(unit)
        assert torch.equal(shard_X, X[unit.shard_start:unit.shard_stop])
        assert torch.equal(shard_y, y[unit.shard_start:unit.shard_stop])
    assert len({u.shard_sha256 for u in units}) == 300 and len({u.seed for u in units}) == 300
    assert all(u.status == WorkUnit.Status.QUEUED and u.reserved_until is not None for u in units)
    # One file for the round: the shards one after another, in the units' order.
    pack = storage.blob_get(rnd.shards_sha256)
    assert [(u.shard_offset, u.shard_size) for u in units] == list(zip(
        [0, *itertools.accumulate(u.shard_size for u in units[:-1])], [u.shard_size for u in units]))
    assert len(pack) == sum(u.shard_size for u in units)
    blobs = [p for p in (Path(settings.MEDIA_ROOT) / "blobs").rglob("*") if p.is_file()]
    assert rnd.shards_sha256 in {p.name for p in blobs}
    assert not {u.shard_sha256 for u in units} & {p.name for p in blobs}


def test_an_upload_sorted_by_label_still_gives_every_shard_a_sample_of_every_class(customer):
    """An image folder's zip holds its classes one after another, and a round's shards are contiguous slices of the
    training split: kept in the upload's order, each device trained on one or two classes."""
    digits = load_digits()
    order = np.argsort(digits.target, kind="stable")
    buf = io.BytesIO()
    np.savez(buf, X=digits.data[order].astype(np.float32), y=digits.target[order].astype(np.int64))
    dataset = jobs.dataset_create(owner=customer, filename="sorted.npz", data=buf.getvalue())
    job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams={}, rounds=1, seed=3)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)

    rnd = jobs.round_open(job_id=job.pk, devices=[(1000 + i, 1.0) for i in range(5)])

    for unit in rnd.units.all():
        _, y = jobs.unit_shard_xy(unit)
        counts = torch.bincount(y, minlength=10)
        assert counts.min() >= 0.5 * len(y) / 10, counts.tolist()  # ~29 of each class in a shard of ~287


def test_a_shard_download_streams_its_range_of_the_pack_with_its_size(customer, make_device):
    job = _running_job(customer, batch_size=1)
    device = make_device("streams")
    jobs.round_open(job_id=job.pk, devices=[(device.device.pk, 10.0), (device.device.pk + 1, 30.0)])
    unit = device.claim()
    assert unit is not None

    response = device.client.get(f"/api/worker/units/{unit['id']}/shard")

    assert response.status_code == 200 and response.streaming
    body = b"".join(response.streaming_content)
    assert int(response["Content-Length"]) == len(body)
    assert storage.sha256_hex(body) == unit["shard_sha256"]


def test_a_damaged_pack_is_refused_and_a_unit_without_an_offset_reads_its_own_blob(customer):
    job = _running_job(customer, batch_size=1)
    rnd = jobs.round_open(job_id=job.pk, devices=[(1, 10.0), (2, 30.0)])
    first, second = rnd.units.order_by("index")

    # A pack whose bytes are not the units' shards (a store that lost or changed them) is never served as one.
    path = Path(default_storage.path(storage.blob_path(rnd.shards_sha256)))
    path.chmod(0o644)
    damaged = bytearray(path.read_bytes())
    damaged[second.shard_offset + second.shard_size // 2] ^= 0xFF
    path.write_bytes(bytes(damaged))
    assert jobs.unit_shard_bytes(first, key=None)  # its bytes are intact
    with pytest.raises(storage.BlobDamaged):
        jobs.unit_shard_bytes(second, key=None)
    # Read as a download streams it, in small pieces: every piece but the one that would complete it comes out.
    streamed, pieces = jobs.unit_shard_open(second, key=None), []
    with pytest.raises(storage.BlobDamaged), streamed:
        while piece := streamed.read(64):
            pieces.append(piece)
    assert 0 < sum(map(len, pieces)) < second.shard_size
    path.write_bytes(bytes(damaged[:second.shard_offset + 1]))  # cut short
    with pytest.raises(storage.BlobDamaged):
        jobs.unit_shard_bytes(second, key=None)

    # Rounds opened before packs (offset null) keep a blob per shard, named by its hash.
    shard = shard_to_bytes(torch.randn(3, 64), torch.arange(3))
    WorkUnit.objects.filter(pk=first.pk).update(shard_sha256=storage.blob_put(shard), shard_offset=None,
                                                shard_size=None)
    first.refresh_from_db()
    assert jobs.unit_shard_bytes(first, key=None) == shard


def test_round_open_for_thousands_of_devices_plans_every_unit_its_shard_reservation_and_deadline(customer, settings):
    rng = np.random.default_rng(5)
    buf = io.BytesIO()
    np.savez(buf, X=rng.normal(size=(12_000, 6)).astype(np.float32), y=rng.integers(0, 4, 12_000))
    dataset = jobs.dataset_create(owner=customer, filename="many.npz", data=buf.getvalue())
    job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams={"batch_size": 1}, rounds=1,
                          seed=4)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    devices = [(50_000 + i, float(rng.uniform(1e6, 4e6))) for i in range(3000)]  # FLOP/s, unequal

    rnd = jobs.round_open(job_id=job.pk, devices=devices)

    job.refresh_from_db()
    units = list(rnd.units.order_by("index"))
    planned = plan_shards(job.n_train, [speed for _, speed in devices], min_shard=1)
    assert len(units) == len(planned) == 3000
    assert [(u.index, u.shard_start, u.shard_stop, u.preferred_device_id) for u in units] == [
        (i, s.start, s.stop, devices[s.device][0]) for i, s in enumerate(planned)]
    assert units[0].shard_start == 0 and units[-1].shard_stop == job.n_train
    assert all(a.shard_stop == b.shard_start for a, b in zip(units, units[1:]))  # every sample, once
    speed = dict(devices)
    for unit in units:
        assert unit.status == WorkUnit.Status.QUEUED and unit.backup_of_id is None and unit.attempts == 0
        assert unit.reserved_until == rnd.opened_at + timedelta(seconds=settings.MUNINN_RESERVATION_SECONDS)
        assert unit.min_memory_bytes == job.peak_memory_bytes and unit.result_metrics == {}
        assert unit.flops == jobs.unit_flops(job, unit.samples)
        assert unit.expected_seconds == pytest.approx(unit.flops / speed[unit.preferred_device_id])
    assert len({u.shard_sha256 for u in units}) == 3000 and len({u.seed for u in units}) == 3000
    X, y = jobs.load_xy(job.train_sha256)
    for unit in units[::97]:
        shard_X, shard_y = jobs.unit_shard_xy(unit)
        assert torch.equal(shard_X, X[unit.shard_start:unit.shard_stop])
        assert torch.equal(shard_y, y[unit.shard_start:unit.shard_stop])
    slowest = max(u.expected_seconds for u in units)
    assert rnd.plan_seconds == pytest.approx(slowest) and rnd.plan_complete and rnd.arrivals == 0
    soft = deadlines.round_deadlines(outstanding=[u.expected_seconds for u in units], arrivals=[],
                                     grace=settings.MUNINN_ROUND_GRACE_SECONDS,
                                     floor=settings.MUNINN_ROUND_DEADLINE_MIN_SECONDS,
                                     ceiling=settings.MUNINN_ROUND_DEADLINE_SECONDS).soft
    assert (rnd.deadline_at - rnd.opened_at).total_seconds() == pytest.approx(soft, abs=1e-5)
    assert job.current_round == 1


def test_round_open_twice_returns_the_open_round_and_writes_nothing_more(customer):
    job = _running_job(customer, batch_size=1)
    devices = [(1, 10.0), (2, 30.0)]

    first = jobs.round_open(job_id=job.pk, devices=devices)
    again = jobs.round_open(job_id=job.pk, devices=devices + [(3, 20.0)])

    assert again.pk == first.pk
    assert WorkUnit.objects.filter(round__job=job).count() == 2
    assert again.shards_sha256 == first.shards_sha256


def test_blobs_put_returns_hashes_in_order_and_stores_identical_blobs_once(settings, tmp_path):
    blobs = [b"shard a", b"shard b", b"shard a", b"shard c"]

    shas = storage.blobs_put(blobs, threads=4)

    assert shas == [storage.sha256_hex(b) for b in blobs]
    assert [storage.blob_get(sha) for sha in shas] == blobs
    assert sorted(p.name for p in (tmp_path / "media" / "blobs").rglob("*") if p.is_file()) == sorted(set(shas))


@pytest.mark.parametrize("others", [0, 70], ids=["one", "many-in-threads"])
def test_a_blob_left_short_by_a_killed_writer_is_written_whole_by_the_next_put(settings, tmp_path, others):
    """A writer killed after creating a blob's file and before writing all of it leaves it short (tests/
    test_faults.py kills the web server there); the next put of the same bytes writes it whole, in its place.
    With `others` distinct blobs beside it (64 and more), blobs_put writes them in threads."""
    settings.FILE_UPLOAD_PERMISSIONS = 0o640
    data = bytes(range(256)) * 64
    sha = storage.sha256_hex(data)
    path = tmp_path / "media" / storage.blob_path(sha)
    path.parent.mkdir(parents=True)
    path.write_bytes(data[:1000])

    shas = storage.blobs_put([data, *(b"another blob %d" % i for i in range(others))]) if others else [
        storage.blob_put(data)]

    assert shas[0] == sha
    assert storage.blob_get(sha) == data
    assert path.stat().st_mode & 0o777 == 0o640  # as a new blob's file
    # nothing of the rewrite left beside it: only the blobs put whose hashes share its folder
    assert sorted(p.name for p in path.parent.iterdir()) == sorted({s for s in shas if s[:2] == sha[:2]})
    assert storage.blob_put(data) == sha and storage.blob_get(sha) == data  # a whole one is left as it is


@pytest.mark.parametrize("X, y", [
    (torch.randn(40, 5), torch.arange(40) % 3),  # a table
    (torch.randn(40, 3, 4, 4), torch.arange(40) % 10),  # images
    (torch.randn(40, 2, dtype=torch.float64), torch.randn(40)),  # regression, sent as float32
    (torch.randint(0, 50, (40, 8)), torch.randint(0, 50, (40, 8))),  # text windows and their next tokens
    (torch.randn(40, 5), (torch.arange(40) % 3).to(torch.int32)),  # labels sent as int64
], ids=["table", "images", "regression", "text", "int32-labels"])
def test_many_shards_cut_at_once_are_the_bytes_the_protocol_sends_one_at_a_time(X, y):
    bounds = [(0, 1), (1, 9), (9, 33), (33, 40), (0, 40), (5, 6)]

    cut = shards.shards_to_bytes(X, y, bounds)

    assert cut == [shard_to_bytes(X[start:stop], y[start:stop]) for start, stop in bounds]
    packed, offsets = shards.pack(cut)
    assert [packed[at:at + len(blob)] for at, blob in zip(offsets, cut)] == cut and len(packed) == sum(map(len, cut))
