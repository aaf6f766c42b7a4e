"""Predictions: rows per second for the digits MLP on the site's endpoint and in the downloaded package's loader,
and the latency of a single-row request.

The benchmark starts the embedded stack as `make run` does (scripts/stack.py: the web server with `--web-workers`
processes, a Celery worker, one `muninn-worker` process), trains a one-round digits MLP through it, downloads the
model, then measures:

- **site, batch**: `POST /api/jobs/<id>/predict` with `--batch` rows as CSV text, `--requests` times from
  `--clients` threads, over HTTP: rows per second;
- **site, one row**: `--single` requests of one row each, one at a time: p50 and p99 milliseconds;
- **loader**: `muninn_worker.load_model(file).predict(csv)` on the same batches in this process: rows per second
  (CSV parsing and encoding included, as on the site).

    .venv/bin/python bench/predict.py [--batch 1000] [--requests 40] [--clients 2] [--single 300]
        [--web-workers 2]

The last line printed is one JSON object (`site_rows_per_s`, `loader_rows_per_s`, `p99_ms`, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform"), str(ROOT / "worker_client")]

from round_latency import _run_job  # noqa: E402  (bench/ is this script's folder; the job as there)
from scripts.stack import ok as _ok  # noqa: E402  (a 2xx answer's JSON, or the script ends saying what came back)


def main() -> int:
    options = _parse_args()
    from scripts.stack import Stack, base_env, free_port

    tmp = Path(tempfile.mkdtemp(prefix="muninn-predict-"))
    env = base_env(DJANGO_SETTINGS_MODULE="muninn.settings", MUNINN_VAR_DIR=str(tmp),
                   DATABASE_URL=f"sqlite:///{tmp / 'muninn.sqlite3'}", MEDIA_ROOT=str(tmp / "media"), DEBUG="false",
                   MUNINN_TLS="false", SECRET_KEY="predict-benchmark-only", ALLOWED_HOSTS="127.0.0.1,localhost",
                   LOG_LEVEL="WARNING", MUNINN_THROTTLE_PREDICT="")
    os.environ.update(env)
    ok = False
    try:
        with Stack(env=env, log_dir=tmp / "log") as stack:
            stack.manage("migrate", "--noinput")
            logins = json.loads(stack.manage("seed_demo"))
            url = stack.web(free_port(), workers=options.web_workers)
            stack.celery_worker()
            config = stack.register_device(url, logins["contributor"]["token"], "device-1")
            stack.worker_client("device-1", config, "--threads", "1")
            stack.wait_for_log("device-1", "muninn-worker")
            figures = measure(url, logins["customer"]["token"], options)
        ok = True
    finally:
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs kept in {tmp / 'log'}", file=sys.stderr)
    _print_table(figures, options)
    print(json.dumps(figures))
    return 0


def measure(url: str, token: str, options: argparse.Namespace) -> dict:
    from muninn_worker import load_model
    from sklearn.datasets import load_digits

    api = _session(token)
    job = {"id": _run_job(url, token, rounds=1)}  # the digits MLP, one epoch, through the live stack
    digits = load_digits()
    predict = f"{url}/api/jobs/{job['id']}/predict"
    header = ",".join(f"x{j}" for j in range(64))
    rows = [",".join(str(int(v)) for v in x) for x in digits.data]
    batch = header + "\n" + "\n".join(rows[i % len(rows)] for i in range(options.batch)) + "\n"
    one = header + "\n" + rows[0] + "\n"
    model_file = api.get(f"{url}/api/jobs/{job['id']}/model")
    model_file.raise_for_status()

    _ok(api.post(predict, json={"csv": batch}))  # the model loaded into (one) web process's cache
    sessions = [_session(token) for _ in range(options.clients)]
    for session in sessions:  # every web process has loaded it before the clock starts
        for _ in range(options.web_workers * 2):
            _ok(session.post(predict, json={"csv": one}))

    def send(i: int) -> int:
        answer = _ok(sessions[i % len(sessions)].post(predict, json={"csv": batch}))
        return len(answer["predictions"])

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=options.clients) as pool:
        predicted = sum(pool.map(send, range(options.requests)))
    site_s = time.perf_counter() - start

    latencies = []
    for _ in range(options.single):
        t0 = time.perf_counter()
        _ok(sessions[0].post(predict, json={"csv": one}))
        latencies.append((time.perf_counter() - t0) * 1000)
    latencies.sort()

    model = load_model(model_file.content)
    model.predict(batch)  # warm
    start = time.perf_counter()
    for _ in range(options.requests):
        local = model.predict(batch)
    loader_s = time.perf_counter() - start
    agree = local == _ok(api.post(predict, json={"csv": batch}))["predictions"]
    return {"site_rows_per_s": round(predicted / site_s), "loader_rows_per_s": round(options.requests * options.batch
                                                                                      / loader_s),
            "p50_ms": round(statistics.median(latencies), 2), "p99_ms": round(_percentile(latencies, 99), 2),
            "batch_rows": options.batch, "requests": options.requests, "clients": options.clients,
            "web_workers": options.web_workers, "single_requests": options.single, "site_equals_loader": agree}


def _session(token: str):
    import requests

    session = requests.Session()
    session.headers["Authorization"] = f"Token {token}"
    return session


def _percentile(sorted_values: list[float], p: float) -> float:
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * len(sorted_values)) - 1))
    return sorted_values[k]


def _print_table(f: dict, options: argparse.Namespace) -> None:
    print(f"\nPredictions with the digits MLP (64 features, 10 classes); {options.web_workers} web processes")
    print(f"{'where':<34}{'rows/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'site, ' + str(f['batch_rows']) + '-row CSV requests':<34}{f['site_rows_per_s']:>12,}{'':>10}{'':>10}")
    print(f"{'site, one-row requests':<34}{'':>12}{f['p50_ms']:>10}{f['p99_ms']:>10}")
    print(f"{'loader (load_model().predict)':<34}{f['loader_rows_per_s']:>12,}{'':>10}{'':>10}")
    print(f"site and loader agree exactly: {f['site_equals_loader']}")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1000, help="rows per batch request")
    parser.add_argument("--requests", type=int, default=40, help="batch requests")
    parser.add_argument("--clients", type=int, default=2, help="threads sending batch requests")
    parser.add_argument("--single", type=int, default=300, help="one-row requests for the latency")
    parser.add_argument("--web-workers", type=int, default=2, help="the web server's processes")
    return parser.parse_args()


if __name__ == "__main__":
    raise SystemExit(main())
