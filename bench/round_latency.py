"""Round latency: the platform's own time per round, with real processes, for 1, 3 and 10 devices.

For each fleet size the benchmark starts a fresh stack as `make demo` does (scripts/stack.py: the web server, a Celery
worker and beat, N `muninn-worker` processes talking HTTP), uploads the digits as the customer and runs an MLP
job of `--rounds` FedAvg rounds, one epoch per unit. Training takes a known time: every worker client sleeps
`--train-seconds` after its epoch (the `train.after_epoch` failpoint, MUNINN_WORKER_FAILPOINTS), which stands
for a real model's training; the digits MLP itself trains in a few hundredths of a second. The receipt's
`train_seconds` includes the sleep, so the site's speed checks see a plausible unit.

From the database afterwards, per round: its wall time (opened_at → closed_at), the slowest accepted unit's
`train_seconds` (the training on the round's critical path) and the difference, the **platform's time**: claims,
downloads, uploads, checks, segment re-executions, aggregation. Per job: the **overhead ratio**, the job's wall
time (started_at → finished_at, so the first round's opening and every gap between rounds count) over the sum of
the rounds' critical-path training. The devices are new, as in `make demo`: the site checks a segment of every
one of their results (re-executed on the Celery worker) before the round can close.

    .venv/bin/python bench/round_latency.py [--devices 1,3,10] [--rounds 5] [--train-seconds 3]
        [--claim-wait 25] [--validators 1] [--database-url URL] [--broker URL] [--keep]

Defaults: the embedded stack (SQLite and the filesystem broker, in a temporary folder). `--database-url
postgres://.../NAME` drops and recreates that database for each fleet; `--broker redis://...` puts Celery (and the
claims' wake-ups) on Redis. `--claim-wait 0` runs the clients as before long-poll claims (idle backoff 1 → 5 s),
for comparison. Each fleet runs in a child process of its own (one Django set-up per database). The last line
printed is one JSON object; `platform_s_per_round_median` and `overhead_ratio` there are the worst fleet's.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform"), str(ROOT / "worker_client")]
from scripts.stack import ENDED, WEB_SERVER, WEB_SERVERS, Stack, base_env, free_port, ok  # noqa: E402

GOAL_PLATFORM_S = 0.3
GOAL_OVERHEAD = 1.10
JOB_TIMEOUT_S = 300


def main() -> int:
    options = _parse_args()
    if options.one is not None:
        print(json.dumps(run_fleet(options, options.one)))
        return 0
    from machine import yardstick_s  # (bench/ is this script's folder)

    yardstick = yardstick_s()  # the machine's speed now, before any stack starts (bench/machine.py)
    print(f"the machine's yardstick: {yardstick:.3f} s (bench/machine.py)", flush=True)
    fleets = []
    for devices in options.devices:
        print(f"{devices} device(s): {options.rounds} rounds of {options.train_seconds:g} s training…", flush=True)
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", str(devices)], cwd=ROOT,
                               capture_output=True, text=True)
        if child.returncode != 0:
            print(child.stdout[-3000:], child.stderr[-5000:], sep="\n", file=sys.stderr)
            return 1
        fleets.append(json.loads(child.stdout.strip().splitlines()[-1]))
        if options.keep:
            print(child.stderr.strip().splitlines()[-1])
    _print_table(fleets, options)
    worst_median = max(f["platform_s_median"] for f in fleets)
    worst_ratio = max(f["overhead_ratio"] for f in fleets)
    print(json.dumps({
        "platform_s_per_round_median": round(worst_median, 3), "goal_platform_s_per_round": GOAL_PLATFORM_S,
        "overhead_ratio": round(worst_ratio, 3), "goal_overhead_ratio": GOAL_OVERHEAD,
        "train_seconds": options.train_seconds, "rounds": options.rounds, "claim_wait": options.claim_wait,
        "validators": options.validators, "after_a_job": options.after_a_job, "server": options.server,
        "yardstick_s": yardstick,
        "database": "postgresql" if options.database_url else "sqlite", "broker": options.broker,
        "fleets": {str(f["devices"]): {k: v for k, v in f.items() if k not in ("devices", "rounds")}
                   for f in fleets},
    }))
    return 0


def run_fleet(options: argparse.Namespace, devices: int) -> dict:
    """One fleet on a fresh stack; returns its rounds' figures. Runs in a child process (see main)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"muninn-rounds-{devices}-"))
    database_url = options.database_url or f"sqlite:///{tmp / 'muninn.sqlite3'}"
    if options.database_url:
        from load_world import recreate_database  # noqa: PLC0415  (bench/ is this script's folder)

        recreate_database(database_url)
    env = base_env(DJANGO_SETTINGS_MODULE="muninn.settings", MUNINN_VAR_DIR=str(tmp), DATABASE_URL=database_url,
                   CELERY_BROKER_URL=options.broker,
                   MEDIA_ROOT=str(tmp / "media"), DEBUG="false", MUNINN_TLS="false", SECRET_KEY="round-latency-benchmark-only",
                   ALLOWED_HOSTS="127.0.0.1,localhost", MUNINN_MAX_DEVICES_PER_ACCOUNT=str(max(devices, 10)),
                   LOG_LEVEL="WARNING")
    os.environ.update(env)
    import django

    django.setup()
    worker_env = {**env, "MUNINN_WORKER_FAILPOINTS": f"train.after_epoch=sleep:{options.train_seconds}"}
    ok = False
    try:
        with Stack(env=env, log_dir=tmp / "log") as stack:
            stack.manage("migrate", "--noinput")
            logins = json.loads(stack.manage("seed_demo"))
            url = stack.web(free_port(), server=options.server)
            stack.celery_worker()
            for n in range(1, options.validators):  # more processes on the validation queue (re-executions)
                stack.celery_worker(f"validator-{n + 1}", queues="validation")
            stack.celery_beat()
            names = [f"device-{i + 1}" for i in range(devices)]
            with ThreadPoolExecutor(max_workers=4) as pool:  # each registration probes the device (imports torch)
                configs = list(pool.map(
                    lambda name: stack.register_device(url, logins["contributor"]["token"], name), names))
            for name, config in zip(names, configs):
                stack.worker_client(name, config, "--threads", "1", "--claim-wait", str(options.claim_wait),
                                    env=worker_env)
            # Every client warmed up and claiming, and the validator warmed up, before the job starts: torch's
            # first-use costs (~1.5 s of CPU a process, most of it importing torch._dynamo) are paid at start, not
            # in a round, and are not counted in the rounds' CPU.
            for name in [*names, "celery-worker"]:
                stack.wait_for_log(name, "torch warmed up", timeout=180)
            api = _customer(url, logins["customer"]["token"])
            if options.after_a_job:  # a site that has served a job before: its processes' first-use costs paid
                _wait_for_job(api, url, _start_job(api, url, options.after_a_job))
            job = _start_job(api, url, options.rounds)  # the web's first estimate imports torch._dynamo too
            before = _cpu_by_part(stack)
            job_id = _wait_for_job(api, url, job)
            spent = {part: seconds - before.get(part, 0.0) for part, seconds in _cpu_by_part(stack).items()}
            ok = True
            return {"devices": devices, **_figures(job_id),
                    "cpu_s_per_round": {part: round(s / options.rounds, 3) for part, s in spent.items()}}
    finally:
        if ok and not options.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept: logs in {tmp / 'log'}, blobs in {tmp / 'media'}", file=sys.stderr)


def _cpu_by_part(stack) -> dict[str, float]:
    """CPU seconds (user + system) each part of the stack has used so far, its child processes included: the web,
    the Celery processes, beat, the worker clients, and every PostgreSQL process on the machine (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")

    def own(pid: int) -> float:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / tick

    def tree(pid: int) -> float:
        children = []
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                children += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
        return own(pid) + sum(tree(c) for c in children)

    parts: dict[str, float] = {}
    for name, proc in stack.procs:
        part = ("clients" if name.startswith("device-") else "celery" if name.startswith(("celery-worker", "validator"))
                else name)
        parts[part] = parts.get(part, 0.0) + tree(proc.pid)
    parts["postgres"] = sum(own(int(p.name)) for p in Path("/proc").iterdir()
                            if p.name.isdigit() and _comm(p) == "postgres")
    return parts


def _comm(proc: Path) -> str:
    try:
        return (proc / "comm").read_text().strip()
    except OSError:
        return ""


def _run_job(url: str, token: str, rounds: int) -> int:
    """The digits MLP job, started and waited for; returns its id."""
    api = _customer(url, token)
    return _wait_for_job(api, url, _start_job(api, url, rounds))


def _customer(url: str, token: str):
    import requests

    api = requests.Session()
    api.headers["Authorization"] = f"Token {token}"
    return api


def _start_job(api, url: str, rounds: int) -> dict:
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    buf = io.BytesIO()
    np.savez(buf, X=digits.data.astype(np.float32), y=digits.target.astype(np.int64))
    dataset = ok(api.post(f"{url}/api/datasets", files={"file": ("digits.npz", buf.getvalue())},
                          data={"name": "digits"}))
    return ok(api.post(f"{url}/api/jobs", json={"dataset": dataset["id"], "template": "mlp", "rounds": rounds,
                                                "hparams": {"epochs": 1}, "seed": 7, "start": True}))


def _wait_for_job(api, url: str, job: dict) -> int:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while job["status"] not in ENDED:
        if time.monotonic() > deadline:
            raise SystemExit(f"job {job['id']} did not finish within {JOB_TIMEOUT_S} s (it is {job['status']})")
        time.sleep(0.5)
        job = ok(api.get(f"{url}/api/jobs/{job['id']}"))
    if job["status"] != "succeeded":
        raise SystemExit(f"job {job['id']} {job['status']}: {job.get('error')}")
    return job["id"]


STEPS = ("lease", "download", "train", "upload", "check", "aggregate")


def _figures(job_id: int) -> dict:
    from contributors.models import Receipt
    from jobs.models import Job, Round, WorkUnit

    job = Job.objects.get(pk=job_id)
    rows = []
    for rnd in Round.objects.filter(job=job).order_by("number"):
        accepted = list(rnd.units.filter(status=WorkUnit.Status.ACCEPTED).order_by("accepted_at"))
        trains = [u.result_metrics.get("train_seconds") or 0.0 for u in accepted]
        wall = (rnd.closed_at - rnd.opened_at).total_seconds()
        last = accepted[-1]  # the unit the round waited for: where its time went
        receipt = Receipt.objects.select_related("lease").get(unit=last, status=Receipt.Status.ACCEPTED)
        steps = {"lease": receipt.lease.created_at - rnd.opened_at,
                 "download": receipt.started_at - receipt.lease.created_at,
                 "train": receipt.finished_at - receipt.started_at,
                 "upload": last.submitted_at - receipt.finished_at, "check": last.accepted_at - last.submitted_at,
                 "aggregate": rnd.closed_at - last.accepted_at}
        rows.append({"round": rnd.number, "units": len(trains), "wall_s": wall, "train_s": max(trains),
                     "platform_s": wall - max(trains),
                     **{f"{k}_s": v.total_seconds() for k, v in steps.items()}})
    platform = [r["platform_s"] for r in rows]
    job_wall = (job.finished_at - job.started_at).total_seconds()
    critical = sum(r["train_s"] for r in rows)
    return {"rounds": rows, "platform_s_median": statistics.median(platform), "platform_s_worst": max(platform),
            "job_wall_s": job_wall, "critical_train_s": critical, "overhead_ratio": job_wall / critical,
            "first_round_s": (Round.objects.get(job=job, number=1).opened_at - job.started_at).total_seconds()}


def _print_table(fleets: list[dict], options: argparse.Namespace) -> None:
    print(f"\nplatform time per round = round wall time - its slowest unit's training ({options.train_seconds:g} s "
          f"sleep + the MLP's own); claim wait {options.claim_wait:g} s")
    print(f"{'devices':>7} {'rounds':>6} {'wall/round':>10} {'platform median':>15} {'platform worst':>14} "
          f"{'job wall':>8} {'critical train':>14} {'overhead':>8}")
    for f in fleets:
        walls = [r["wall_s"] for r in f["rounds"]]
        print(f"{f['devices']:>7} {len(f['rounds']):>6} {statistics.median(walls):>9.2f}s "
              f"{f['platform_s_median']:>14.3f}s {f['platform_s_worst']:>13.3f}s {f['job_wall_s']:>7.1f}s "
              f"{f['critical_train_s']:>13.1f}s {f['overhead_ratio']:>8.3f}")
    print(f"goals: platform median <= {GOAL_PLATFORM_S} s, overhead <= {GOAL_OVERHEAD}\n")
    print("where a round's platform time goes, median over rounds, for the unit it waited for last: lease (round "
          "opened → claimed), download (→ training started), train (→ done, as the client timed it), upload (training done → result in), check (→ "
          "accepted: challenged segments uploaded and re-executed), aggregate (→ round closed)")
    print(f"{'devices':>7} " + " ".join(f"{step:>9}" for step in STEPS) + f" {'job→round 1':>11}")
    for f in fleets:
        print(f"{f['devices']:>7} " + " ".join(
            f"{statistics.median(r[step + '_s'] for r in f['rounds']):>8.3f}s" for step in STEPS)
            + f" {f['first_round_s']:>10.3f}s")
    print("\nCPU seconds per round, by part of the stack (its processes and their children; postgres: every "
          "PostgreSQL process on the machine)")
    parts = sorted({part for f in fleets for part in f["cpu_s_per_round"]})
    print(f"{'devices':>7} " + " ".join(f"{part:>9}" for part in parts) + f" {'all':>9}")
    for f in fleets:
        cpu = f["cpu_s_per_round"]
        print(f"{f['devices']:>7} " + " ".join(f"{cpu.get(part, 0.0):>8.3f}s" for part in parts)
              + f" {sum(cpu.values()):>8.3f}s")
    print()


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=lambda s: [int(x) for x in s.split(",")], default=[1, 3, 10],
                        help="fleet sizes, comma-separated (default 1,3,10)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--train-seconds", type=float, default=3.0,
                        help="the sleep that stands for each unit's training (default 3)")
    parser.add_argument("--claim-wait", type=float, default=25.0,
                        help="the worker clients' --claim-wait (0: poll with backoff, as before long-poll claims)")
    parser.add_argument("--database-url", default="",
                        help="a PostgreSQL database to drop and recreate per fleet (default: SQLite in a temp folder)")
    parser.add_argument("--broker", default="muninnfs://", help="Celery broker URL (default: the filesystem one)")
    parser.add_argument("--validators", type=int, default=1,
                        help="Celery processes taking re-executions: the stack's worker, and this many minus one "
                             "on the validation queue alone (default 1)")
    parser.add_argument("--after-a-job", type=int, default=0, metavar="ROUNDS",
                        help="first run a job of this many rounds on the same stack and measure the next one: a "
                             "site past its processes' first use (each web thread's database connection and its "
                             "PostgreSQL backend's caches), as a site is once it has served (default 0: a fresh stack)")
    parser.add_argument("--server", choices=WEB_SERVERS, default=WEB_SERVER,
                        help=f"the site's HTTP server (default {WEB_SERVER}, as the site is deployed)")
    parser.add_argument("--keep", action="store_true",
                        help="keep each fleet's folder (logs, blobs) for inspection; the database is kept anyway")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child process running one fleet
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
