"""`muninn-worker simulate` against the platform: the same digits job, 8 devices, uploaded sorted by class (the site
cuts contiguous shards of a training split it keeps in a seeded shuffled order), run through the real API and
services with devices simulated in-process, and by `muninn_worker.simulation` in one call."""
from __future__ import annotations

import io

import numpy as np
import pytest
from muninn_worker import simulation, tensors
from sklearn.datasets import load_digits

from jobs import storage
from jobs.models import Job

from .conftest import SimulatedDevice, named_file

pytestmark = pytest.mark.django_db(transaction=True)

DEVICES, ROUNDS, SEED = 8, 2, 3


class SteadyDevice(SimulatedDevice):
    """A device whose clock says it trains at exactly its probe's 1,000 samples/s: eight of them are equally
    fast in the site's eyes round after round, as the simulation's devices are (real timings would size the
    later rounds' shards by a busy test machine's noise)."""

    def train(self, unit: dict, *, data=None) -> tuple[bytes, dict]:
        out, receipt = super().train(unit, data=data)
        return out, {**receipt, "train_seconds": receipt["steps"] * unit["train"]["batch_size"] / 1000.0}


def sorted_digits_npz() -> bytes:
    """174 images of each digit (all the 8s there are), sorted by label: 1,392 training rows after the
    holdout, 174 per device."""
    digits = load_digits()
    rows = np.concatenate([np.flatnonzero(digits.target == c)[:174] for c in range(10)])
    buf = io.BytesIO()
    np.savez(buf, X=digits.data[rows].astype(np.float32), y=digits.target[rows].astype(np.int64))
    return buf.getvalue()


def test_simulate_reproduces_the_platforms_job_on_label_sorted_digits_with_eight_devices(customer_api, contributor):
    data = sorted_digits_npz()
    devices = [SteadyDevice(contributor, f"d{i}") for i in range(DEVICES)]
    dataset = customer_api.post("/api/datasets", {"file": named_file(data, "digits.npz")}, format="multipart").json()
    created = customer_api.post("/api/jobs", {"dataset": dataset["id"], "template": "mlp", "rounds": ROUNDS,
                                              "seed": SEED, "hparams": {"epochs": 1}, "start": True}, format="json")
    assert created.status_code == 201, created.content
    for _ in range(ROUNDS * DEVICES * 2):
        if Job.objects.get(pk=created.json()["id"]).is_ended:
            break
        for device in devices:
            device.work_one()
    job = Job.objects.get(pk=created.json()["id"])
    assert job.status == Job.Status.SUCCEEDED, job.error
    platform_rounds = list(job.round_set.order_by("number"))

    simulated = list(simulation.simulate(
        simulation.job_prepare(data, "digits.npz", template="mlp", hparams={"epochs": 1}, seed=SEED),
        rounds=ROUNDS, devices=DEVICES))

    assert [r.metrics["units"] for r in platform_rounds] == [DEVICES] * ROUNDS
    assert [r.devices for r in simulated] == [DEVICES] * ROUNDS
    # Uploaded sorted by class, and still every device's shard holds every digit (the split's shuffled order).
    assert all(sum(1 for n in counts if n) == 10 for counts in simulated[0].shard_labels)
    final = platform_rounds[-1].metrics["test_accuracy"]
    assert abs(simulated[-1].metrics["accuracy"] - final) <= 0.01  # the promise: within one point
    # and in fact bit for bit: every round's held-out metrics, and the final weights.
    assert [(r.metrics["test_accuracy"], r.metrics["test_loss"], r.metrics["train_loss"]) for r in platform_rounds] \
        == [(r.metrics["accuracy"], r.metrics["loss"], r.train_loss) for r in simulated]
    assert tensors.state_dict_to_bytes(simulated[-1].state) == storage.blob_get(job.global_weights_sha256)
