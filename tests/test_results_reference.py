"""A round's global weights are decoded once per web process and shared by every result of the round it checks
(contributors.results._reference): nothing on a result's path may write into them."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from muninn.lru import SizedLRU
from muninn_worker import tensors, zoo

from contributors import results
from jobs import storage
from jobs.models import Job

from .test_spine import create_job, run_until_done

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_shared_global_weights_come_out_of_every_check_as_they_went_in(customer_api, digits_dataset,
                                                                          make_device):
    results._REFERENCES.clear()
    devices = [make_device("a"), make_device("b")]  # new devices: their results are challenged, checkpoints checked
    job = create_job(customer_api, digits_dataset["id"], rounds=3)

    done = run_until_done(devices, job["id"])

    assert done.status == Job.Status.SUCCEEDED
    rounds = list(done.round_set.order_by("number"))
    kept = [r.weights_sha256 for r in rounds if r.weights_sha256 in results._REFERENCES]
    assert len(kept) == len(rounds) == 3  # every round's results were checked against the one shared copy
    for sha in kept:
        shared, stored = results._REFERENCES.get(sha), tensors.bytes_to_state_dict(storage.blob_get(sha))
        assert shared.keys() == stored.keys()
        for name, tensor in stored.items():
            assert torch.equal(shared[name], tensor), f"round weights {sha[:12]}: {name} was written to"


def test_rounds_are_kept_by_their_bytes_the_oldest_out_first_and_none_too_large(monkeypatch):
    blobs = [tensors.state_dict_to_bytes({"w": torch.full((4,), float(n))}) for n in range(6)]
    size = len(blobs[0])
    monkeypatch.setattr(results, "_REFERENCES", SizedLRU(4 * size, largest=size))  # room for four such rounds
    for data in blobs:
        decoded = results._reference(storage.sha256_hex(data), data)
        assert torch.equal(decoded["w"], tensors.bytes_to_state_dict(data)["w"])
    assert results._REFERENCES.keys() == [storage.sha256_hex(d) for d in blobs[-4:]]
    first = results._REFERENCES.get(storage.sha256_hex(blobs[-1]))
    assert results._reference(storage.sha256_hex(blobs[-1]), blobs[-1]) is first  # decoded once

    big = tensors.state_dict_to_bytes({"w": torch.full((8,), -1.0)})  # over the largest a round may be
    assert results._reference(storage.sha256_hex(big), big)["w"][0] == -1.0
    assert storage.sha256_hex(big) not in results._REFERENCES
    assert len(results._REFERENCES) == 4


def test_forty_jobs_check_models_stay_built_and_a_thread_keeps_no_more_than_its_bytes(monkeypatch):
    """bench/load.py's 40 jobs: a count of eight per thread rebuilt nearly every result's model."""
    jobs = [SimpleNamespace(pk=n, base_weights_id=None, template="mlp",
                            model_config={"in_features": 8, "num_classes": 3, "hidden": [4]}) for n in range(40)]
    built = []
    real_build = zoo.build_model
    monkeypatch.setattr(zoo, "build_model", lambda *a, **k: built.append(a) or real_build(*a, **k))
    monkeypatch.setattr(results, "_CHECK_MODELS", threading.local())
    for _ in range(2):
        for job in jobs:
            model = results._check_model(job, real_build(job.template, job.model_config).state_dict())
            assert isinstance(model, torch.nn.Module)
    assert len(built) == 40  # each built once, then reused

    size = sum(t.numel() * t.element_size() for t in real_build("mlp", jobs[0].model_config).state_dict().values())
    monkeypatch.setattr(results, "CHECK_MODELS_BYTES", 10 * size)
    monkeypatch.setattr(results, "_CHECK_MODELS", threading.local())
    built.clear()
    for job in jobs:
        results._check_model(job, real_build(job.template, job.model_config).state_dict())
    kept = results._CHECK_MODELS.by_job
    assert len(kept) == 10 and kept.bytes == 10 * size and kept.keys() == list(range(30, 40))
