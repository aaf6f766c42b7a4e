"""bench/load.py's round planning: `jobs.services.round_open` (shards ∝ throughput, one unit and one shard
blob per device) and the pure `jobs.sharding.plan_shards`, for 10, 100 and 1,000 online devices."""
from __future__ import annotations

import argparse
import io
import time
from datetime import UTC, datetime

PLAN_SIZES = (10, 100, 1000)
PLAN_ROWS = 40_000  # planning data set: 1,000 devices of speeds 200..5,000 samples/s all get a shard
PLAN_HPARAMS = {"hidden": [16], "batch_size": 2, "epochs": 1}


def plan_timings(options: argparse.Namespace) -> dict[int, dict[str, float]]:
    """round_open and plan_shards for 10, 100 and 1,000 online devices (best of `--plan-repeats`): wall
    time, and this process's CPU time (the Python side of round_open, its blob-writing threads included)."""
    import numpy as np
    from django.conf import settings
    from muninn_worker import signing

    from accounts.models import User
    from contributors import selectors
    from contributors import services as contributors
    from contributors.models import Device
    from jobs import services as jobs
    from jobs.models import Job
    from jobs.sharding import plan_shards

    customer = User.objects.get(username="customer")
    contributor = User.objects.get(username="contributor")
    rng = np.random.default_rng(0)
    settings.MUNINN_MAX_DEVICES_PER_ACCOUNT = max(PLAN_SIZES)  # one contributor account holds the whole market
    for i in range(Device.objects.count(), max(PLAN_SIZES)):
        key = signing.public_key_of(signing.new_private_key())  # a key registers one device only
        speed = float(rng.uniform(200, 5000))  # a market of unequal devices
        contributors.device_register(owner=contributor, name=f"plan-{i}", public_key=key, capabilities={
            "cpu_cores": 2, "ram_bytes": 8 * 2**30, "backends": ["cpu"], "gpus": [], "torch_version": "2.13.0",
            "samples_per_s": speed})
    centres = rng.normal(size=(10, 32))
    y = rng.integers(0, 10, PLAN_ROWS)
    X = (centres[y] + rng.normal(scale=0.5, size=(PLAN_ROWS, 32))).astype(np.float32)
    buf = io.BytesIO()
    np.savez(buf, X=X, y=y.astype(np.int64))
    dataset = jobs.dataset_create(owner=customer, filename="blobs.npz", data=buf.getvalue())
    timings: dict[int, dict[str, float]] = {}
    for size in PLAN_SIZES:
        Device.objects.update(last_seen_at=datetime.now(UTC))
        online = selectors.device_capacities_online()[:size]
        opens, cpu, units = [], [], 0
        for repeat in range(options.plan_repeats):
            job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", rounds=1, seed=repeat,
                                  hparams=PLAN_HPARAMS)
            Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING, started_at=datetime.now(UTC))
            t0, c0 = time.perf_counter(), time.process_time()
            rnd = jobs.round_open(job_id=job.pk, devices=online)
            opens.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            units = rnd.units.count()
        speeds = [speed for _, speed in online]
        pure = []
        for _ in range(max(5, options.plan_repeats)):
            t0 = time.perf_counter()
            plan_shards(job.n_train, speeds, min_shard=PLAN_HPARAMS["batch_size"])
            pure.append(time.perf_counter() - t0)
        timings[size] = {"round_open_ms": min(opens) * 1e3, "round_open_max_ms": max(opens) * 1e3,
                         "round_open_cpu_ms": min(cpu) * 1e3,
                         "plan_shards_ms": min(pure) * 1e3, "units": units, "n_train": job.n_train}
    return timings
