"""`make run` (scripts/run.sh) keeps the platform up when its local worker client ends, says which process ended and
why, keeps its logs, and prints the command that lifts a quarantined local device (`manage.py device_quarantine`)."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from django.core.management import CommandError, call_command

from contributors.models import Device, DeviceEvent
from scripts.stack import free_port

from .conftest import register_device

ROOT = Path(__file__).resolve().parent.parent


# --- manage.py device_quarantine ---------------------------------------------------------------------

def quarantine(device: Device, reason: str = "failures confirmed on 3 units") -> None:
    Device.objects.filter(pk=device.pk).update(quarantined_at="2026-01-01T00:00:00Z", quarantine_reason=reason)


def command(*args: str) -> str:
    out = io.StringIO()
    call_command("device_quarantine", *args, stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_device_quarantine_command_shows_the_standing_and_lifts_it_on_record(staff, contributor):
    device = register_device(contributor, "local-worker")
    assert command(str(device.pk)).startswith(f"ok: device #{device.pk} (local-worker) is not quarantined")
    quarantine(device)
    assert command(str(device.pk)).startswith(f"quarantined: device #{device.pk} (local-worker) since 2026-01-01")

    out = command(str(device.pk), "--lift", "--reason", "local demo worker checked", "--by", "staff")

    device.refresh_from_db()
    assert "lifted the quarantine" in out and device.quarantined_at is None
    event = device.events.get(kind=DeviceEvent.Kind.LIFTED)
    assert (event.actor, event.reason) == (staff, "local demo worker checked")


@pytest.mark.django_db
@pytest.mark.parametrize("args, message", [
    (["--lift", "--by", "staff"], "Say why"),
    (["--lift", "--reason", "ok", "--by", "bob"], "--by must name a staff account"),
    (["--lift", "--reason", "ok"], "--by must name a staff account"),
])
def test_device_quarantine_command_refuses_a_lift_without_reason_or_staff(staff, contributor, args, message):
    device = register_device(contributor, "local-worker")
    quarantine(device)

    with pytest.raises(CommandError, match=message):
        command(str(device.pk), *args)

    device.refresh_from_db()
    assert device.quarantined_at is not None and not device.events.exists()


@pytest.mark.django_db
def test_device_quarantine_command_names_a_missing_device_and_a_device_not_quarantined(staff, contributor):
    device = register_device(contributor, "local-worker")
    with pytest.raises(CommandError, match="No device #999999"):
        command("999999")
    with pytest.raises(CommandError, match="not quarantined"):
        command(str(device.pk), "--lift", "--reason", "ok", "--by", "staff")


# --- scripts/run.sh with real processes ---------------------------------------------------------------

def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.e2e
def test_make_run_survives_its_worker_client_and_prints_how_to_lift_its_quarantine(tmp_path):
    """On the embedded defaults (SQLite, the filesystem broker), in a var/ of its own."""
    var, port = tmp_path / "var", free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL")}
    env.update(MUNINN_VAR_DIR=str(var), MUNINN_PORT=str(port), MUNINN_PYTHON=sys.executable, PYTHONUNBUFFERED="1",
               PYTHONPATH=f"{ROOT / 'platform'}:{ROOT}")
    (var / "log").mkdir(parents=True)
    (var / "log" / "web.log").write_text("a line from an earlier run\n")

    def manage(*args: str) -> str:
        return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True,
                              capture_output=True, text=True).stdout

    manage("migrate", "--noinput")
    out_path = tmp_path / "run.out"
    with open(out_path, "wb") as out:
        run = subprocess.Popen(["bash", "scripts/run.sh"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        wait_for(lambda: "Muninn is running" in out_path.read_text(), 120, "make run to start")
        device_id = json.loads((var / "worker-client.json").read_text())["device_id"]
        wait_for(lambda: "muninn-worker" in (var / "log" / "worker-client.log").read_text(), 60, "the worker")

        # The device is quarantined: its next claim is refused and the worker client exits.
        manage("shell", "-c", "from contributors.models import Device; from django.utils import timezone; "
               f"Device.objects.filter(pk={device_id}).update(quarantined_at=timezone.now(), "
               "quarantine_reason='failures confirmed on 3 units')")
        report = wait_for(lambda: "Start it again" in (text := out_path.read_text()) and text, 90,
                          "the report of the worker's end")

        assert "the local worker client (pid" in report and "ended with exit code 1" in report
        assert "worker-client.log:" in report and "refuses this device" in report  # the log's last lines
        assert f"device: quarantined: device #{device_id} (local-worker)" in report
        lift = f"manage.py device_quarantine {device_id} --lift --reason"
        assert lift in report
        assert run.poll() is None  # the platform is still running …
        assert requests.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200  # … and answers

        # The printed command works.
        line = next(ln for ln in report.splitlines() if lift in ln).strip()
        lifted = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True)
        assert lifted.returncode == 0 and "lifted the quarantine" in lifted.stdout, lifted.stderr
        assert manage("device_quarantine", str(device_id)).startswith("ok:")

        # Logs are appended to, each run's start marked.
        web_log = (var / "log" / "web.log").read_text()
        assert web_log.startswith("a line from an earlier run\n")
        assert "make run: starting the web server" in web_log
    finally:
        run.send_signal(signal.SIGTERM)  # as Ctrl-C would: run.sh's trap stops its processes
        try:
            run.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    assert "stopping…" in out_path.read_text()
