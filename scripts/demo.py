"""`make demo`: the whole life of a job, headless, on the embedded defaults.

Starts the site (its web server), a Celery worker and beat, and 3 worker-client processes; uploads scikit-learn's
bundled digits as the customer; estimates; runs a 10-round FedAvg MLP job; prints each round's test
accuracy; downloads the model; stops everything. The last line is one JSON object.
"""
from __future__ import annotations

import io
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import requests
from safetensors.torch import load as load_safetensors
from sklearn.datasets import load_digits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.stack import ENDED, ROOT, Stack, base_env, free_port, ok, watch_job  # noqa: E402

ROUNDS = 10
DEVICES = 3
TIMEOUT_S = 170


def digits_npz() -> bytes:
    digits = load_digits()
    buf = io.BytesIO()
    np.savez(buf, X=digits.data.astype(np.float32), y=digits.target.astype(np.int64))
    return buf.getvalue()


def main() -> int:
    started = time.monotonic()
    var = ROOT / "var" / "demo"
    shutil.rmtree(var, ignore_errors=True)
    env = base_env(MUNINN_VAR_DIR=str(var), DATABASE_URL=f"sqlite:///{var / 'muninn.sqlite3'}",
                   CELERY_BROKER_URL="muninnfs://", MEDIA_ROOT=str(var / "media"), DEBUG="1",
                   MUNINN_LEASE_SECONDS="30", LOG_LEVEL="WARNING")
    with Stack(env=env, log_dir=var / "log") as stack:
        stack.manage("migrate", "--noinput")
        logins = json.loads(stack.manage("seed_demo"))
        url = stack.web(free_port())
        stack.celery_worker()
        stack.celery_beat()
        for i in range(DEVICES):
            config = stack.register_device(url, logins["contributor"]["token"], f"demo-device-{i + 1}")
            stack.worker_client(f"worker-{i + 1}", config, "--threads", "1")
        print(f"site {url}, Celery worker + beat, {DEVICES} worker clients started", flush=True)

        api = requests.Session()
        api.headers["Authorization"] = f"Token {logins['customer']['token']}"
        dataset = ok(api.post(f"{url}/api/datasets", files={"file": ("digits.npz", digits_npz())},
                               data={"name": "digits"}))
        print(f"uploaded digits: {dataset['profile']['rows']} rows, {dataset['profile']['features']} features, "
              f"{dataset['profile']['num_classes']} classes", flush=True)
        choice = {"dataset": dataset["id"], "template": "mlp", "rounds": ROUNDS, "hparams": {}, "seed": 7}
        estimate = ok(api.post(f"{url}/api/estimates", json=choice))
        print(f"estimate: {estimate['hu']} HU, {estimate['price']['display']}", flush=True)
        job = ok(api.post(f"{url}/api/jobs", json={**choice, "start": True}))

        job = watch_job(api, url, job["id"], started=started, timeout=TIMEOUT_S)
        if job["status"] not in ENDED:
            print(f"timed out; job is {job['status']}. Logs in {var / 'log'}", file=sys.stderr)
            return 1
        if job["status"] != "succeeded":
            print(f"job {job['status']}: {job['error']}", file=sys.stderr)
            return 1

        model = api.get(f"{url}/api/jobs/{job['id']}/model")
        model.raise_for_status()
        weights = load_safetensors(model.content)
        (var / "model.safetensors").write_bytes(model.content)
        charges = ok(api.get(f"{url}/api/jobs/{job['id']}/charges"))
        devices = ok(api.get(f"{url}/api/jobs/{job['id']}/devices"))
        print(f"model downloaded: {len(weights)} tensors, {len(model.content):,} bytes -> {var / 'model.safetensors'}")
        print(f"charged {charges['charged']['display']} of the {charges['quoted']['display']} held; "
              f"released {charges['released']['display']}; done in {time.monotonic() - started:.1f}s")
    print(json.dumps({
        "job": job["id"], "rounds": len(job["round_list"]), "test_accuracy": job["metrics"]["test_accuracy"],
        "hu_estimated": charges["hu_estimated"], "hu_credited": charges["hu_charged"],
        "devices": len(devices["devices"]),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
