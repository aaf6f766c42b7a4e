"""bench/load.py's round planning: `jobs.services.round_open` (shards ∝ throughput, one unit per device, the
round's shards in one blob) and the pure `federated.sharding.plan_shards`, for 10, 100, 1,000 and 10,000 online devices.

Alone, without the load phases (drops and recreates its own PostgreSQL database):

    .venv/bin/python bench/load_planning.py [--plan-repeats 3] [--database-url postgres://…/muninn_plan_bench]
"""
from __future__ import annotations

import argparse
import io
import json
import secrets
import sys
import time
from datetime import UTC, datetime

PLAN_SIZES = (10, 100, 1000, 10_000)
# Planning data set: 10,000 devices of speeds 2..50 GFLOP/s (25× apart) all get a shard of at least a batch
# (the slowest one's share is 400,000 × 2 / (10,000 × 26) ≈ 3 rows). 16 features keep it under the upload limit.
PLAN_ROWS = 400_000
PLAN_FEATURES = 16
PLAN_HPARAMS = {"hidden": [16], "batch_size": 2, "epochs": 1}
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/muninn_plan_bench"


def plan_timings(options: argparse.Namespace) -> dict[int, dict[str, float]]:
    """round_open and plan_shards for each of PLAN_SIZES online devices (best and worst of `--plan-repeats`):
    wall time, and this process's CPU time (the Python side of round_open, its blob-writing threads included)."""
    import numpy as np

    from accounts.models import User
    from contributors import selectors
    from contributors.models import Device
    from jobs import services as jobs
    from jobs.models import Job
    from muninn_worker.federated.sharding import plan_shards

    customer = User.objects.get(username="customer")
    contributor = User.objects.get(username="contributor")
    rng = np.random.default_rng(0)
    _market(contributor, Device, rng)
    market = set(Device.objects.filter(name__startswith="plan-").values_list("id", flat=True))
    centres = rng.normal(size=(10, PLAN_FEATURES))
    y = rng.integers(0, 10, PLAN_ROWS)
    X = (centres[y] + rng.normal(scale=0.5, size=(PLAN_ROWS, PLAN_FEATURES))).astype(np.float32)
    buf = io.BytesIO()
    np.savez(buf, X=X, y=y.astype(np.int64))
    dataset = jobs.dataset_create(owner=customer, filename="blobs.npz", data=buf.getvalue())
    timings: dict[int, dict[str, float]] = {}
    for size in PLAN_SIZES:
        Device.objects.update(last_seen_at=datetime.now(UTC))
        online = [d for d in selectors.device_capacities_online() if d[0] in market][:size]
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


def _market(contributor, Device, rng) -> None:
    """The largest market, written straight to the table (registering 10,000 devices one at a time through
    contributors.services.device_register would be the slow part of the benchmark, not what it measures):
    unequal measured speeds, all online, each with its own token and key. bench/load.py's own devices (speed
    unknown) are left out of the plans."""
    missing = max(PLAN_SIZES) - Device.objects.filter(name__startswith="plan-").count()
    capabilities = {"cpu_cores": 2, "ram_bytes": 8 * 2**30, "backends": ["cpu"], "gpus": [],
                    "torch_version": "2.13.0"}
    Device.objects.bulk_create([
        Device(owner=contributor, name=f"plan-{i}", token_hash=secrets.token_hex(32),
               public_key=secrets.token_urlsafe(32), capabilities=capabilities, memory_bytes=8 * 2**30,
               flops_per_s=float(rng.uniform(2e9, 5e10)), last_seen_at=datetime.now(UTC))
        for i in range(missing)
    ], batch_size=2000)


def print_table(plans: dict[int, dict[str, float]], repeats: int) -> None:
    print(f"\nround planning (best of {repeats}; {plans[PLAN_SIZES[0]]['n_train']:,} training rows)")
    print(f"{'devices':>8}{'units':>7}{'round_open ms':>15}{'(worst)':>9}{'CPU ms':>8}{'plan_shards ms':>16}")
    for size, t in plans.items():
        print(f"{size:>8}{t['units']:>7}{t['round_open_ms']:>15.1f}{t['round_open_max_ms']:>9.1f}"
              f"{t['round_open_cpu_ms']:>8.1f}{t['plan_shards_ms']:>16.3f}")


def main() -> int:
    """The planning part alone, in a fresh database of its own."""
    import logging
    import os
    import shutil
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root), str(root / "platform"), str(root / "worker_client")]
    from load_world import environment, recreate_database
    from machine import yardstick_s

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan-repeats", type=int, default=3, help="timed round_open runs per size (default 3)")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL,
                        help=f"PostgreSQL database to DROP and recreate (default {DEFAULT_DATABASE_URL})")
    options = parser.parse_args()
    if options.plan_repeats <= 0:
        parser.error("--plan-repeats must be positive")
    yardstick = yardstick_s()  # the machine's speed now (bench/machine.py)
    print(f"the machine's yardstick: {yardstick:.3f} s (bench/machine.py)")
    options.devices, options.broker = max(PLAN_SIZES), "muninnfs://"
    tmp = Path(tempfile.mkdtemp(prefix="muninn-plan-"))
    os.environ.update(environment(options, tmp))
    recreate_database(options.database_url)

    import django

    django.setup()
    logging.disable(logging.INFO)
    from django.core.management import call_command

    from accounts import services as accounts
    from accounts.models import User

    call_command("migrate", verbosity=0)
    accounts.user_create(username="customer", password="plan-customer-123", role=User.Role.CUSTOMER)
    accounts.user_create(username="contributor", password="plan-contrib-123", role=User.Role.CONTRIBUTOR)
    plans = plan_timings(options)
    print_table(plans, options.plan_repeats)
    print(json.dumps({
        **{f"plan_ms_{size}": round(t["round_open_ms"], 1) for size, t in plans.items()},
        **{f"plan_max_ms_{size}": round(t["round_open_max_ms"], 1) for size, t in plans.items()},
        **{f"plan_cpu_ms_{size}": round(t["round_open_cpu_ms"], 1) for size, t in plans.items()},
        "yardstick_s": yardstick,
    }))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
