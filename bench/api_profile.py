"""Where the worker API's CPU goes: each operation's CPU time and SQL queries, and the result's parts.

In one process, with no web server in the way: a fresh PostgreSQL database (`muninn_profile`, dropped and
recreated), 20 veteran devices (as bench/load.py's: their results are accepted without a re-execution 95 % of the
time) and 1,000 queued units of small MLP jobs. Each device's loop goes through Django's full request path (the
test client builds a WSGI request: middleware, DRF, authentication, the view) for

    claim → heartbeat → result (the global weights nudged, signed; every cheap check runs on it)

and this process's CPU time (`time.process_time`) and Django's captured queries are counted per operation. The
result's parts (the lease lookup, the checks, the acceptance, the answer, ...) are timed by wrapping those
functions; a part this checkout does not have is left out, so the same script measures an older checkout. The
tasks the site enqueues (re-executions, aggregations, credits) are not run during the loop: the charges owed are
posted afterwards, in the credit task's batches, and timed per result as the Celery worker's CPU.

CPU time is the figure to compare (wall time swings with whatever else the machine runs); PostgreSQL's own
CPU is not in it (bench/load.py measures that, under gunicorn).

    .venv/bin/python bench/api_profile.py [--ops 300] [--database-url postgres://...] [--cprofile 40]

The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import io
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform"), str(ROOT / "worker_client"), str(ROOT / "bench")]

import load_world  # noqa: E402
from machine import disk_note, settled_disk_ms  # noqa: E402

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/muninn_profile"
DEVICES = 20
QUEUED_UNITS = 1000
WARM_UP = 20  # loops not counted: first requests build caches, import lazily, compile regular expressions
# The result's parts: (module, function, label). Nested parts are shown indented under the part they are in.
PARTS = [
    ("contributors.results", "result_submit", "result_submit (all the service does)"),
    ("contributors.services", "leased_unit", "  the lease lookup"),
    ("contributors.results", "_live_with", "  duplicate and replay lookup"),
    ("contributors.results", "_check", "  the cheap checks"),
    ("contributors.checks", "check_signature", "    signature"),
    ("contributors.checks", "decode_update", "    decoding the update"),
    ("contributors.results", "_norm_bound", "    the job's norm bound"),
    ("contributors.results", "_shard_losses", "    loss on 64 samples of the shard"),
    ("jobs.storage", "blob_put", "  storing the upload and its state"),
    ("contributors.results", "_accept", "  acceptance (one transaction)"),
    ("jobs.services", "unit_accept_with", "    the unit, its round and the receipt, sent together"),
    ("contributors.api", "credited_payload", "the answer's money fields"),
]


def main() -> int:
    options = _parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="muninn-profile-"))
    os.environ.update({
        "DJANGO_SETTINGS_MODULE": "muninn.settings", "DATABASE_URL": options.database_url,
        "CELERY_BROKER_URL": "memory://", "DEBUG": "false", "SECRET_KEY": "profile-benchmark-only",
        "ALLOWED_HOSTS": "testserver", "MUNINN_VAR_DIR": str(tmp), "MEDIA_ROOT": str(tmp / "media"),
        "MUNINN_MAX_DEVICES_PER_ACCOUNT": str(DEVICES),
        # bench/load.py's world: veterans checked 5 % of the time
        "MUNINN_MIN_CHECK_RATE": load_world.CHECK_FLOOR, "MUNINN_TLS": "false",
    })
    from load_world import recreate_database

    recreate_database(options.database_url)
    import django

    django.setup()
    import logging

    logging.disable(logging.WARNING)
    import torch
    from django.core.management import call_command

    torch.set_num_threads(1)  # as the web process (platform/muninn/wsgi.py)
    call_command("migrate", verbosity=0)
    disk_ms = settled_disk_ms(tmp / "disk-probe")  # beside the blobs (MEDIA_ROOT): their writes are a part timed below
    devices = _world()
    _hold_tasks()
    timed = _wrap_parts()
    if os.environ.get("API_PROFILE_SHOW_QUERIES"):
        _record_statements()

    ops: dict[str, list[tuple[float, int]]] = defaultdict(list)
    rng = random.Random(0)
    weights_cache: dict = {}
    for i in range(WARM_UP):
        _loop(devices[i % len(devices)], ops, weights_cache, rng)
    ops.clear()
    for part in timed.values():
        part.clear()
    profiler = None
    if options.cprofile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    for i in range(options.ops):
        _loop(devices[i % len(devices)], ops, weights_cache, rng)
    if profiler is not None:
        profiler.disable()
    credit = _credit_owed()
    _report(options, ops, timed, credit, profiler, disk_ms)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _world() -> list[tuple]:
    from datetime import UTC, datetime

    from django.test import Client
    from muninn_worker import signing

    from accounts import services as accounts
    from accounts.models import User
    from billing import money
    from billing import services as billing
    from contributors import services as contributors
    from contributors.models import Device
    from jobs import services as jobs
    from jobs.models import WorkUnit
    from load_world import JOB_HPARAMS, VETERAN_STREAK, digits_npz
    from muninn.celery import app

    staff = accounts.user_create(username="staff", password="profile-staff-123", role=User.Role.STAFF)
    customer = accounts.user_create(username="customer", password="profile-cust-123", role=User.Role.CUSTOMER)
    billing.balance_grant(user=customer, amount=money.to_nanos("100000"), reason="profile", granted_by=staff)
    contributor = accounts.user_create(username="contributor", password="profile-contrib-123",
                                       role=User.Role.CONTRIBUTOR)
    capabilities = {"cpu_cores": 2, "ram_bytes": 8 * 2**30, "backends": ["cpu"], "gpus": [],
                    "torch_version": "2.13.0", "samples_per_s": 1000.0}
    devices = []
    for i in range(DEVICES):
        key = signing.new_private_key()
        _, token = contributors.device_register(owner=contributor, name=f"profile-{i}", capabilities=capabilities,
                                                public_key=signing.public_key_of(key))
        devices.append((Client(HTTP_AUTHORIZATION=f"Device {token}"), key))
    Device.objects.update(verified_streak=VETERAN_STREAK, verified_total=VETERAN_STREAK, samples_per_s=1000.0)
    app.conf.task_always_eager = True  # job_start opens round 1 at once
    dataset = jobs.dataset_create(owner=customer, filename="digits.npz", data=digits_npz())
    seed = 0
    while WorkUnit.objects.filter(status=WorkUnit.Status.QUEUED).count() < QUEUED_UNITS:
        Device.objects.update(last_seen_at=datetime.now(UTC))
        job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams=JOB_HPARAMS, rounds=1,
                              seed=seed)
        jobs.job_start(job_id=job.pk)
        seed += 1
    app.conf.task_always_eager = False
    return devices


def _hold_tasks() -> None:
    """The tasks the site enqueues wait: Celery's work, not the request's (their messages go nowhere)."""
    for module, name in (("contributors.tasks", "verify_unit"), ("contributors.tasks", "credit_results"),
                         ("jobs.tasks", "aggregate_round")):
        task = getattr(importlib.import_module(module), name, None)
        if task is not None:
            task.delay = lambda *args, **kwargs: None


def _wrap_parts() -> dict[str, list[float]]:
    timed: dict[str, list[float]] = {}
    for module_name, function, label in PARTS:
        module = importlib.import_module(module_name)
        original = getattr(module, function, None)
        if original is None:
            continue
        spent = timed[label] = []

        def wrapper(*args, _original=original, _spent=spent, **kwargs):
            start = time.process_time()
            try:
                return _original(*args, **kwargs)
            finally:
                _spent.append(time.process_time() - start)

        setattr(module, function, functools.wraps(original)(wrapper))
    return timed


_STATEMENTS: list[str] = []  # API_PROFILE_SHOW_QUERIES: the texts muninn/sql.py ran in the current op


def _record_statements() -> None:
    from muninn import sql

    run = sql._run

    def recorded(statement, params, read, **options):
        _STATEMENTS.append(statement)
        return run(statement, params, read, **options)

    sql._run = recorded


def _loop(device: tuple, ops: dict, weights_cache: dict, rng: random.Random) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from muninn_worker import signing, tensors

    import load

    client, key = device

    def op(name: str, call):
        _STATEMENTS.clear()
        with CaptureQueriesContext(connection) as queries:
            start = time.process_time()
            response = call()
            spent = time.process_time() - start
        ops[name].append((spent, len(queries)))
        if os.environ.get("API_PROFILE_SHOW_QUERIES") and len(ops[name]) == 50:  # one warm op of each kind
            # muninn/sql.py's prepared statements are captured without their text: the texts come from _STATEMENTS
            texts = iter(_STATEMENTS)
            print(f"--- {name}: {len(queries)} queries", file=sys.stderr)
            for query in queries:
                print("   ", str(query["sql"] or next(texts, "?"))[:200], file=sys.stderr)
        return response

    answer = op("claim", lambda: client.post("/api/worker/claim", "{}", content_type="application/json"))
    if answer.status_code != 200:
        raise SystemExit(f"claim: {answer.status_code} {answer.content[:300]!r}")
    unit = answer.json()["unit"]
    op("heartbeat", lambda: client.post(f"/api/worker/units/{unit['id']}/heartbeat"))
    sha = unit["weights_sha256"]
    if sha not in weights_cache:
        body = b"".join(client.get(f"/api/worker/units/{unit['id']}/weights").streaming_content)
        weights_cache[sha] = tensors.bytes_to_state_dict(body)
    weights, receipt = load._result(unit, weights_cache[sha], time.monotonic() - 0.01, rng)
    text = json.dumps(receipt)
    form = {"weights": io.BytesIO(weights), "receipt": text, "signature": signing.sign(key, text.encode())}
    answer = op("result", lambda: client.post(f"/api/worker/units/{unit['id']}/result", form))
    if answer.status_code != 201:
        raise SystemExit(f"result: {answer.status_code} {answer.content[:300]!r}")


def _credit_owed() -> dict:
    """Post the charges the results left owed, as the credit task does, and time it per result (bench/load.py's
    own; a checkout from before credits were posted off the request has none, and nothing owed)."""
    import load

    return load._credit_owed() if hasattr(load, "_credit_owed") else {}


def _report(options, ops: dict, timed: dict, credit: dict, profiler, disk_ms: float) -> None:
    import statistics

    n_results = len(ops["result"])
    print(f"worker API in one process: {DEVICES} veteran devices, {QUEUED_UNITS:,} queued units, {options.ops} loops "
          f"(after {WARM_UP} to warm up); CPU time of this process; load average {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} CPUs; {disk_note(disk_ms)}\n")
    print(f"{'op':10}{'CPU ms (mean)':>15}{'(median)':>10}{'queries':>9}")
    figures = {}
    for name in ("claim", "heartbeat", "result"):
        cpu = [c for c, _ in ops[name]]
        queries = statistics.mean(q for _, q in ops[name])
        print(f"{name:10}{statistics.mean(cpu) * 1e3:>15.2f}{statistics.median(cpu) * 1e3:>10.2f}{queries:>9.1f}")
        figures[name] = {"cpu_ms": round(statistics.mean(cpu) * 1e3, 2), "queries": round(queries, 1)}
    mean_op = statistics.mean(c for name in ("claim", "heartbeat", "result") for c, _ in ops[name])
    print(f"{'mean op':10}{mean_op * 1e3:>15.2f}")
    if credit:
        print(f"credit task, per result charged afterwards: {credit['cpu_ms_per_result']} ms "
              f"({credit['results']} results)")
    print("\nthe result's parts, CPU ms per result (nested parts are inside the one above them)")
    for label, spent in timed.items():
        if spent:
            print(f"  {label:46}{sum(spent) / n_results * 1e3:>8.2f}")
    if profiler is not None:
        import pstats

        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(options.cprofile)
        print(stream.getvalue())
    print(json.dumps({
        **{f"{name}_cpu_ms": f["cpu_ms"] for name, f in figures.items()},
        **{f"{name}_queries": f["queries"] for name, f in figures.items()},
        "mean_op_cpu_ms": round(mean_op * 1e3, 2),
        "credit_cpu_ms_per_result": credit.get("cpu_ms_per_result"),
        "parts_ms_per_result": {label.strip(): round(sum(s) / n_results * 1e3, 2) for label, s in timed.items() if s},
        "ops": options.ops, "load_average": round(os.getloadavg()[0], 2), "new_file_ms": disk_ms,
    }))


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=300, help="loops of claim, heartbeat, result (default 300)")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL,
                        help=f"PostgreSQL database to DROP and recreate (default {DEFAULT_DATABASE_URL})")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also run cProfile over the loops and print its N costliest functions (by own time)")
    options = parser.parse_args()
    if options.ops <= 0:
        parser.error("--ops must be positive")
    return options


if __name__ == "__main__":
    sys.exit(main())
