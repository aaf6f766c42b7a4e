"""Honest GPUs end to end: does a real CUDA device's work pass the site's verification, on a live stack?

Starts the platform on the embedded defaults (the web server, a Celery worker consuming the validation queue, beat;
SQLite, the filesystem broker, local files) and `muninn-worker run` processes that train on this machine's GPU;
uploads generated shape images as the customer; runs a resnet18 job (the GPU tier) to the end; downloads the
model; then reads every receipt, its verification evidence (the site's CPU validator re-training the challenged
segments from the device's own checkpoints, or peers re-training them when MUNINN_VALIDATOR_BACKENDS leaves cuda
out) and every device's failures and quarantine.

    python bench/gpu_e2e.py [--template resnet18] [--devices 2] [--rounds 3] [--validator-backends cpu,cuda]

Without CUDA a GPU-tier job has no device to run on: it says so and exits 2 (`--template cnn` runs the same
path on the CPU). Last line: JSON with `honest_gpu_pass` (job succeeded, every unit accepted, no receipt
refused for being wrong, no device failure or quarantine), the GPU's name, receipts by status, segments
re-trained, and the worst distance against its tolerance.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import requests
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "worker_client")]
from muninn_worker.samples import image_folder_zip, synthetic_images

from scripts.stack import ENDED, Stack, base_env, free_port, ok, watch_job

GPU_TIER = {"resnet18"}

# Run by `manage.py shell -c` against the stack's database: what the site decided, as JSON.
REPORT = r"""
import json
from contributors.models import Device, PeerCheck, Receipt
from jobs.models import Job
job = Job.objects.get(pk=JOB_ID)
receipts = []
for r in Receipt.objects.filter(unit__round__job=job).select_related("device", "unit__round"):
    v = (r.verification or {}).get("segment_check") or {}
    checked = v.get("segments", [])
    segments = [s for s in checked if s.get("distance") is not None]
    suspect = (r.verification or {}).get("suspect") or []
    receipts.append({"device": r.device.name, "round": r.unit.round.number, "status": r.status,
                     "reason": r.reason, "validator": v.get("validator", ""),
                     "segment_steps": r.segment_steps, "challenged": list(r.challenge_segments), "suspect": suspect,
                     "tolerance": v.get("tolerance"), "distances": [s["distance"] for s in segments],
                     "second_opinions": [s["second_opinion"]["passed_by"] or "failed" for s in checked
                                         if "second_opinion" in s],
                     "steps": r.steps, "train_seconds": r.train_seconds})
peer = [{"segment": c.segment, "status": c.status, "distance": c.distance}
        for c in PeerCheck.objects.filter(receipt__unit__round__job=job)]
devices = [{"name": d.name, "failures": d.failures, "quarantined": d.quarantined_at is not None,
            "reason": d.quarantine_reason, "verified_total": d.verified_total}
           for d in Device.objects.all()]
print(json.dumps({"receipts": receipts, "peer_checks": peer, "devices": devices,
                  "job": {"status": job.status, "error": job.error, "backends": job.backend_list}}))
"""

# With --validator-backends leaving the job's backend out, peers check its segments, and only trusted devices take
# peer checks (contributors.peers: a verified streak, then exposure's policy): the devices start as veterans.
VETERANS = r"""
from datetime import timedelta
from django.utils import timezone
from contributors import exposure, reputation
from contributors.models import Device
policy = exposure.policy_current()
Device.objects.update(verified_streak=reputation.TRUST_AFTER, verified_total=max(policy.min_verified_units, 5),
                      created_at=timezone.now() - timedelta(days=policy.min_device_age_days + 1))
"""

# One contributor account per device: a peer never checks its own owner's work.
OWNERS = r"""
import json, secrets
from accounts import services
from accounts.models import User
print(json.dumps([services.token_for(user=services.user_create(
    username=f"gpu-owner-{i + 1}", password=secrets.token_urlsafe(), role=User.Role.CONTRIBUTOR))
    for i in range(DEVICES)]))
"""


def shapes_zip(per_class: int, size: int) -> bytes:
    return image_folder_zip(*synthetic_images(per_class=per_class, size=size, seed=11), ["h", "v", "box"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", default="resnet18")
    parser.add_argument("--devices", type=int, default=2, help="worker clients, all on this machine's GPU")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-class", type=int, default=160, help="generated images per class (3 classes)")
    parser.add_argument("--hparams", default='{"base_width": 32, "image_size": 32, "epochs": 2}')
    parser.add_argument("--validator-backends", default="cpu,cuda",
                        help="MUNINN_VALIDATOR_BACKENDS: leave cuda out to have peers check GPU segments")
    parser.add_argument("--timeout", type=float, default=420.0)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name(0) if cuda else None
    if args.template in GPU_TIER and not cuda:
        print(f"{args.template} runs only on CUDA devices and this machine has none; "
              "try --template cnn to run the same path on the CPU", file=sys.stderr)
        return 2
    hparams = json.loads(args.hparams)
    if args.template != "resnet18":
        hparams.pop("base_width", None)

    started = time.monotonic()
    var = ROOT / "var" / "gpu_e2e"
    shutil.rmtree(var, ignore_errors=True)
    env = base_env(MUNINN_VAR_DIR=str(var), DATABASE_URL=f"sqlite:///{var / 'muninn.sqlite3'}",
                   CELERY_BROKER_URL="muninnfs://", MEDIA_ROOT=str(var / "media"), DEBUG="1",
                   MUNINN_LEASE_SECONDS="60", LOG_LEVEL="WARNING",
                   MUNINN_VALIDATOR_BACKENDS=args.validator_backends)
    with Stack(env=env, log_dir=var / "log") as stack:
        stack.manage("migrate", "--noinput")
        logins = json.loads(stack.manage("seed_demo"))
        stack.manage("grant_credit", "customer", "10000.00", "--reason", "bench/gpu_e2e.py", "--by", "staff")
        url = stack.web(free_port())
        stack.celery_worker()
        stack.celery_beat()
        owners = json.loads(stack.manage("shell", "-c", OWNERS.replace("DEVICES", str(args.devices))).splitlines()[-1])
        configs = [stack.register_device(url, token, f"gpu-device-{i + 1}") for i, token in enumerate(owners)]
        peers = ("cuda" if args.template in GPU_TIER else "cpu") not in args.validator_backends.split(",")
        if peers:
            stack.manage("shell", "-c", VETERANS)
        for i, config in enumerate(configs):
            stack.worker_client(f"worker-{i + 1}", config, "--threads", "2")
        print(f"GPU: {gpu or 'none'}; site {url}, Celery worker + beat, {args.devices} worker client(s)"
              f"{' (veterans: peers check the segments)' if peers else ''}", flush=True)

        api = requests.Session()
        api.headers["Authorization"] = f"Token {logins['customer']['token']}"
        dataset = ok(api.post(f"{url}/api/datasets", files={"file": ("shapes.zip", shapes_zip(args.per_class, 32))},
                              data={"name": "shapes"}))
        print(f"uploaded shapes: {dataset['profile']['rows']} images", flush=True)
        choice = {"dataset": dataset["id"], "template": args.template, "rounds": args.rounds,
                  "hparams": hparams, "seed": 7}
        estimate = ok(api.post(f"{url}/api/estimates", json=choice))
        print(f"estimate: {estimate['hu']} HU, {estimate['price']['display']}", flush=True)
        job = ok(api.post(f"{url}/api/jobs", json={**choice, "start": True}))
        job = watch_job(api, url, job["id"], started=started, timeout=args.timeout, every=0.5)
        if job["status"] not in ENDED:
            print(f"timed out; job is {job['status']}: {job.get('waiting')}", file=sys.stderr)
        model_bytes = 0
        if job["status"] == "succeeded":
            model = api.get(f"{url}/api/jobs/{job['id']}/model")
            model_bytes = len(model.content) if model.ok else 0
        report = json.loads(stack.manage("shell", "-c", REPORT.replace("JOB_ID", str(job["id"]))).splitlines()[-1])
        for name in [f"worker-{i + 1}" for i in range(args.devices)] + ["celery-worker"]:
            shutil.copy(var / "log" / f"{name}.log", var / f"{name}.log")

    receipts, devices = report["receipts"], report["devices"]
    print(f"\n{'device':<14} {'round':>5} {'status':<9} {'k':>2} {'validator':<10} {'challenged':<12} "
          f"{'worst distance':>14} {'tolerance':>9}  reason")
    worst, worst_tolerance, segments = 0.0, None, 0
    for r in receipts:
        top = max(r["distances"], default=None)
        segments += len(r["distances"])
        if top is not None and (r["tolerance"] and top / r["tolerance"] >= worst / (worst_tolerance or 1)):
            worst, worst_tolerance = top, r["tolerance"]
        distance = "" if top is None else f"{top:.2e}"
        tolerance = "" if r["tolerance"] is None else f"{r['tolerance']:.1e}"
        suspect = f"suspect: {', '.join(map(str, r['suspect']))}" if r["suspect"] else ""
        if r["second_opinions"]:  # segments outside the tolerance, re-trained in other arithmetic before a verdict
            suspect += f" second opinion: {', '.join(r['second_opinions'])}"
        print(f"{r['device']:<14} {r['round']:>5} {r['status']:<9} {r['segment_steps']:>2} {r['validator']:<10} "
              f"{r['challenged']!s:<12} {distance:>14} {tolerance:>9}  {r['reason'][:60]}{suspect}")
    tolerance = next((r["tolerance"] for r in receipts if r["tolerance"]), None)
    for c in report["peer_checks"]:
        print(f"peer check segment {c['segment']}: {c['status']} distance {c['distance']}")
        if c["distance"] is not None:
            segments += 1
            if tolerance and c["distance"] / tolerance >= worst / (worst_tolerance or 1):
                worst, worst_tolerance = c["distance"], tolerance
    for d in devices:
        print(f"{d['name']}: failures {d['failures']}, quarantined {d['quarantined']} {d['reason']}, "
              f"verified {d['verified_total']}")
    wrong = [r for r in receipts if r["status"] == "rejected" and not r["reason"].startswith("superseded")]
    passed = (job["status"] == "succeeded" and not wrong and all(r["status"] != "pending" for r in receipts)
              and not any(d["failures"] or d["quarantined"] for d in devices))
    print(json.dumps({
        "honest_gpu_pass": passed, "gpu": gpu, "template": args.template, "job_status": job["status"],
        "job_error": report["job"]["error"], "backends": report["job"]["backends"],
        "validator_backends": args.validator_backends, "rounds": len(job["round_list"]),
        "test_accuracy": (job.get("metrics") or {}).get("test_accuracy"),
        "receipts": {s: sum(r["status"] == s for r in receipts) for s in ("accepted", "rejected", "pending")},
        "refused_as_wrong": len(wrong), "segments_retrained": segments, "peer_checks": len(report["peer_checks"]),
        "worst_distance": worst, "its_tolerance": worst_tolerance,
        "second_opinions": sum(len(r["second_opinions"]) for r in receipts),
        "device_failures": sum(d["failures"] for d in devices),
        "quarantined": sum(d["quarantined"] for d in devices), "model_bytes": model_bytes,
        "wall_s": round(time.monotonic() - started, 1)}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
