"""A client that respects its owner (issue 14): real `muninn-worker` processes against a live site keep to their
working hours, pause while the machine is busy without dropping the unit in hand, report the device's standing
with `status`, and install themselves as a user service. Also the site's side: claims that ask for some of the
device's backends only, and GET /api/worker/me."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from accounts import services as accounts
from contributors.models import DeviceEvent, Lease, Receipt
from jobs.models import WorkUnit

from .conftest import CAPABILITIES, SimulatedDevice, digits_npz, named_file

ROOT = Path(__file__).resolve().parent.parent
live = pytest.mark.django_db(transaction=True)


def _env(**extra: str) -> dict[str, str]:
    """This checkout's worker client first, whatever an editable install elsewhere points at (scripts/stack.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MUNINN_", "XDG_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "worker_client"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


def _worker(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "muninn_worker", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or _env())


def _register(contributor, server: str, tmp_path: Path, name: str = "laptop") -> Path:
    config = tmp_path / f"{name}.json"
    done = _worker("register", "--server", server, "--token", accounts.token_for(user=contributor), "--name", name,
                   "--config", str(config))
    assert done.returncode == 0, done.stderr
    return config


def _job(customer_api, rounds: int = 1) -> int:
    dataset = customer_api.post("/api/datasets", {"file": named_file(digits_npz(200), "digits.npz")},
                                format="multipart")
    job = customer_api.post("/api/jobs", {"dataset": dataset.json()["id"], "template": "mlp", "rounds": rounds,
                                          "start": True}, format="json")
    assert job.status_code == 201, job.content
    return job.json()["id"]


def _device_id(config: Path) -> int:
    return json.loads(config.read_text())["device_id"]


def _hhmm(moment: datetime) -> str:
    return f"{moment:%H:%M}"


class _Running:
    """A worker client process whose output is collected line by line while it runs."""

    def __init__(self, *args: str, env: dict) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "muninn_worker", *args], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 60) -> int:
        """The index of the first line holding `text`, waiting for it up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, line in enumerate(list(self.lines)):
                if text in line:
                    return i
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line with {text!r} in:\n" + "\n".join(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


# ------------------------------------------------------------------------------------- working hours


@live
def test_a_worker_outside_its_working_hours_claims_nothing_and_one_inside_them_works(
        contributor, customer_api, live_server, tmp_path):
    config = _register(contributor, live_server.url, tmp_path)
    _job(customer_api)
    now = datetime.now()
    closed = f"{_hhmm(now + timedelta(hours=2))}-{_hhmm(now + timedelta(hours=3))}"
    opened = f"{_hhmm(now - timedelta(hours=1))}-{_hhmm(now + timedelta(hours=1))}"
    cache = str(tmp_path / "cache")

    paused = _worker("run", "--config", str(config), "--cache-dir", cache, "--schedule", closed,
                     "--exit-when-idle", "3")

    assert paused.returncode == 0, paused.stderr
    assert f"paused: outside the working hours {closed}; resuming at {closed[:5]}" in paused.stderr
    assert not Lease.objects.filter(device_id=_device_id(config)).exists()
    assert WorkUnit.objects.filter(status=WorkUnit.Status.QUEUED).count() == 1

    worked = _worker("run", "--config", str(config), "--cache-dir", cache, "--schedule", opened, "--max-units", "1")

    assert worked.returncode == 0, worked.stderr
    assert "accepted" in worked.stderr and "paused" not in worked.stderr
    assert Receipt.objects.get(device_id=_device_id(config)).status == Receipt.Status.ACCEPTED


# ------------------------------------------------------------------------------------------------ busy


@live
def test_a_busy_machine_pauses_after_the_unit_in_hand_and_resumes_when_its_owner_is_done(
        contributor, customer_api, live_server, tmp_path):
    config = _register(contributor, live_server.url, tmp_path)
    _job(customer_api, rounds=2)
    load = tmp_path / "load"
    load.write_text("0")
    worker = _Running("run", "--config", str(config), "--cache-dir", str(tmp_path / "cache"),
                      "--pause-when-busy", "50", "--max-units", "2",
                      env=_env(MUNINN_WORKER_FAKE_LOAD_FILE=str(load),
                               MUNINN_WORKER_FAILPOINTS="train.after_epoch=1*sleep:2"))
    try:
        worker.wait_for("failpoint train.after_epoch reached")  # a unit in hand, half trained
        load.write_text("90")  # the owner starts something heavy

        paused = worker.wait_for("paused: the machine is busy (other processes use 90% CPU, above 50%)")
        first = Receipt.objects.get(device_id=_device_id(config))
        assert worker.wait_for("accepted") < paused  # the unit in hand was finished and uploaded first
        assert first.status == Receipt.Status.ACCEPTED
        assert not DeviceEvent.objects.filter(kind=DeviceEvent.Kind.ABANDONED).exists()
        time.sleep(2)
        assert list(WorkUnit.objects.filter(round__number=2).values_list("status", flat=True)) == ["queued"]

        load.write_text("10")  # done

        resumed = worker.wait_for("resumed: the machine is no longer busy (other processes use 10% CPU, at most 50%)")
        assert worker.proc.wait(timeout=120) == 0, "\n".join(worker.lines)
    finally:
        worker.stop()
    assert resumed > paused
    assert sum("paused:" in line for line in worker.lines) == 1  # one line for the pause, however long
    assert Receipt.objects.filter(device_id=_device_id(config), status=Receipt.Status.ACCEPTED).count() == 2


# ---------------------------------------------------------------------------------------------- status


@live
def test_status_shows_the_device_numbers_after_a_unit(contributor, customer_api, live_server, tmp_path):
    config = _register(contributor, live_server.url, tmp_path)
    _job(customer_api)
    worked = _worker("run", "--config", str(config), "--cache-dir", str(tmp_path / "cache"), "--max-units", "1")
    assert worked.returncode == 0, worked.stderr

    status = _worker("status", "--config", str(config))
    answer = json.loads(_worker("status", "--config", str(config), "--json").stdout)

    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0] == f"device {_device_id(config)} (laptop) on {live_server.url}; backends: cpu"
    assert lines[1] == "reputation: 1 verified in a row, 1 verified in all; not quarantined"
    assert lines[2].startswith("today (since ")  # the amount as the site shows it: to the cent, "< €0.01" below
    assert re.search(r"1 unit\(s\) accepted, 0 being checked, 0 refused; earned (< )?€\d+\.\d\d$", lines[2]), lines[2]
    assert answer["today"]["accepted"] == 1 and answer["today"]["earned_nanos"] > 0
    earnings = answer["earnings"]
    assert earnings["pending_nanos"] == answer["today"]["earned_nanos"] and earnings["available_nanos"] == 0
    assert lines[3] == (f"earnings (your account, all devices): {earnings['pending']} pending, €0.00 held for review, "
                        "€0.00 available")


def test_me_answers_the_device_and_no_one_else(contributor, make_device):
    device = make_device("rig")
    device.device.quarantined_at, device.device.quarantine_reason = datetime.now().astimezone(), "failed checks."
    device.device.save()

    answer = device.client.get("/api/worker/me")
    account = APIClient()
    account.credentials(HTTP_AUTHORIZATION=f"Token {accounts.token_for(user=contributor)}")

    assert answer.status_code == 200
    body = answer.json()
    assert body["device"]["id"] == device.device.pk and body["device"]["name"] == "rig"
    assert body["reputation"] == {"verified_streak": 0, "verified_total": 0, "failures": 0, "quarantined": True,
                                  "quarantined_at": body["reputation"]["quarantined_at"],
                                  "quarantine_reason": "failed checks."}
    assert body["today"]["accepted"] == 0 and body["earnings"]["available"] == "€0.00"
    assert account.get("/api/worker/me").status_code in (401, 403)


# ------------------------------------------------------------------------------------ backends (--gpu-only)


@live  # the round opens once the job's start commits
def test_a_claim_for_cuda_only_gets_no_cpu_work_and_a_device_without_cuda_is_told(contributor, customer_api):
    gpu = SimulatedDevice(contributor, "gpu", capabilities={
        **CAPABILITIES, "backends": ["cpu", "cuda"], "gpus": [{"name": "RTX", "memory_bytes": 8 * 2**30}]})
    cpu = SimulatedDevice(contributor, "cpu")
    _job(customer_api)  # mlp: a CPU job

    for_cuda = gpu.client.post("/api/worker/claim", {"backends": ["cuda"]}, format="json")
    without_cuda = cpu.client.post("/api/worker/claim", {"backends": ["cuda"]}, format="json")
    unknown = cpu.client.post("/api/worker/claim?backends=tpu", {}, format="json")
    any_backend = gpu.client.post("/api/worker/claim", {}, format="json")

    assert for_cuda.status_code == 204
    assert without_cuda.status_code == 400 and without_cuda.json()["error"]["code"] == "bad_backends"
    assert "registered with cpu only" in without_cuda.json()["error"]["message"]
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "bad_backends"
    assert any_backend.status_code == 200 and any_backend.json()["unit"]["template"] == "mlp"


# --------------------------------------------------------------------------------------------- service


def test_service_install_writes_the_user_unit_with_this_python_the_config_and_the_options(tmp_path):
    config = tmp_path / "worker.json"
    config.write_text(json.dumps({"server": "http://127.0.0.1:9", "device_token": "t", "device_id": 1}))
    home = tmp_path / "home"

    done = _worker("service", "install", "--config", str(config), "--schedule", "22:00-07:00", "--max-threads", "2",
                   "--pause-when-busy", "50", env=_env(HOME=str(home)))

    assert done.returncode == 0, done.stderr
    unit = (home / ".config" / "systemd" / "user" / "muninn-worker.service").read_text()
    assert (f"ExecStart={sys.executable} -m muninn_worker run --config {config} --max-threads 2 "
            "--schedule 22:00-07:00 --pause-when-busy 50\n") in unit
    assert f"Environment=PYTHONPATH={ROOT / 'worker_client'}\n" in unit  # a checkout: the service needs the path
    assert "systemctl --user daemon-reload && systemctl --user enable --now muninn-worker" in done.stdout

    printed = _worker("service", "install", "--print", "--config", str(config), env=_env(HOME=str(tmp_path / "h2")))
    assert printed.returncode == 0 and printed.stdout.startswith("[Unit]")
    assert not (tmp_path / "h2").exists()
