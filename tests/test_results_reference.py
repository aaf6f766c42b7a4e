"""A round's global weights are decoded once per web process and shared by every result of the round it checks
(contributors.results._reference): nothing on a result's path may write into them."""
from __future__ import annotations

import pytest
import torch
from muninn_worker import tensors

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
        shared, stored = results._REFERENCES[sha], tensors.bytes_to_state_dict(storage.blob_get(sha))
        assert shared.keys() == stored.keys()
        for name, tensor in stored.items():
            assert torch.equal(shared[name], tensor), f"round weights {sha[:12]}: {name} was written to"


def test_only_small_weights_are_kept_and_the_oldest_go_first(monkeypatch):
    results._REFERENCES.clear()
    blobs = [tensors.state_dict_to_bytes({"w": torch.full((4,), float(n))}) for n in range(results.REFERENCES_KEPT + 2)]
    for data in blobs:
        decoded = results._reference(storage.sha256_hex(data), data)
        assert torch.equal(decoded["w"], tensors.bytes_to_state_dict(data)["w"])
    assert list(results._REFERENCES) == [storage.sha256_hex(d) for d in blobs[-results.REFERENCES_KEPT:]]
    first = results._REFERENCES[storage.sha256_hex(blobs[-1])]
    assert results._reference(storage.sha256_hex(blobs[-1]), blobs[-1]) is first  # decoded once

    monkeypatch.setattr(storage, "CACHE_BYTES", 8 * (len(blobs[0]) - 1))  # now each is over the per-blob limit
    big = tensors.state_dict_to_bytes({"w": torch.full((4,), -1.0)})
    assert results._reference(storage.sha256_hex(big), big)["w"][0] == -1.0
    assert storage.sha256_hex(big) not in results._REFERENCES
