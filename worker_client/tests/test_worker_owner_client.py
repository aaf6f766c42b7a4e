"""The owner's choices in the client: the work loop holds its claims while paused and finishes the unit in hand,
--gpu-only asks for CUDA work only, `status` reads the site's answer back, and `service install` writes a unit
that runs this very client with the chosen options (tests/test_worker_owner.py runs them against a live site)."""

from __future__ import annotations

import json
import os
import plistlib
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

import muninn_worker
from muninn_worker.api import ApiClient
from muninn_worker.owner import Rules
from muninn_worker.pause import ENV_FAKE_LOAD, CpuLoad, Gate
from muninn_worker.runner import DeviceRejected, run
from muninn_worker.service import launchd_plist, schtasks_command, service_for, systemd_unit
from muninn_worker.signing import new_private_key
from muninn_worker.status import format_status

PACKAGE_ROOT = Path(muninn_worker.__file__).resolve().parent.parent


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def _client(site) -> ApiClient:
    return ApiClient(site.url, device_token=site.device_token, attempts=2, retry_sleep=lambda s: None,
                     signing_key=new_private_key())


def test_a_busy_machine_claims_nothing_until_its_owner_is_done(fake_site, tmp_path):
    fake_site.add_unit(unit_id=42, samples=64, epochs=1)
    load = tmp_path / "load"
    load.write_text("90")
    claims_while_paused = []

    def sleep(seconds: float) -> None:  # the gate waits: note what the site saw, then the owner's job ends
        claims_while_paused.append(len(fake_site.claim_waits))
        load.write_text("10")

    gate = Gate(Rules(busy_above=50), cpu=CpuLoad(env={ENV_FAKE_LOAD: str(load)}), sleep=sleep)

    stats = run(_client(fake_site), cache_dir=tmp_path / "cache", max_units=1, gate=gate)

    assert claims_while_paused == [0]
    assert stats.accepted == 1 and [r["unit"] for r in fake_site.results] == [42]


def test_a_pause_that_begins_during_a_unit_lets_it_finish_first(fake_site, tmp_path):
    fake_site.add_unit(unit_id=42, samples=64, epochs=1)
    fake_site.add_unit(unit_id=43, samples=64, epochs=1)
    load = tmp_path / "load"
    load.write_text("0")
    gate = Gate(Rules(busy_above=50), cpu=CpuLoad(env={ENV_FAKE_LOAD: str(load)}))
    real_submit = ApiClient.submit_result

    def busy_during_upload(self, *args, **kwargs):
        load.write_text("95")  # the owner starts something heavy while the unit is in hand
        return real_submit(self, *args, **kwargs)

    client = _client(fake_site)
    client.submit_result = busy_during_upload.__get__(client)

    stats = run(client, cache_dir=tmp_path / "cache", exit_when_idle=0.5, gate=gate)

    assert [r["unit"] for r in fake_site.results] == [42] and stats.accepted == 1  # finished, then paused
    assert len(fake_site.claim_waits) == 1 and [u.id for u in fake_site.queue] == [43]


def test_gpu_only_claims_ask_for_cuda_work(fake_site, tmp_path):
    run(_client(fake_site), cache_dir=tmp_path / "cache", exit_when_idle=0, backends=["cuda"])

    assert fake_site.claim_backends == [["cuda"]]


def test_a_site_that_has_no_such_work_for_the_device_stops_the_worker(fake_site, tmp_path):
    fake_site.claim_statuses, fake_site.claim_error_code = [400], "bad_backends"

    with pytest.raises(DeviceRejected, match="Forced status 400"):
        run(_client(fake_site), cache_dir=tmp_path / "cache", exit_when_idle=5, backends=["cuda"])


def test_status_prints_the_device_reputation_today_and_earnings():
    answer = {"device": {"id": 7, "name": "laptop", "backends": ["cpu", "cuda"]},
              "reputation": {"verified_streak": 3, "verified_total": 12, "failures": 1, "quarantined": True,
                             "quarantine_reason": "failed checks on 3 units"},
              "today": {"since": "2026-11-21T00:00:00Z", "accepted": 4, "pending": 1, "rejected": 0,
                        "earned_nanos": 344, "earned": "€0.000000344"},
              "earnings": {"currency": "EUR", "pending": "€0.12", "held": "€0.00", "available": "€1.50"}}

    text = format_status(answer, "http://site", local=timezone.utc, today=datetime(2026, 11, 21, 15, tzinfo=timezone.utc))

    assert text.splitlines() == [
        "device 7 (laptop) on http://site; backends: cpu, cuda",
        "reputation: 3 verified in a row, 12 verified in all, 1 failed check(s); QUARANTINED (gets no work): "
        "failed checks on 3 units",
        "today (since 00:00): 4 unit(s) accepted, 1 being checked, 0 refused; earned €0.000000344",
        "earnings (your account, all devices): €0.12 pending, €0.00 held for review, €1.50 available"]


def test_the_systemd_unit_runs_the_command_and_does_not_restart_after_a_refusal():
    unit = systemd_unit(["/opt/py 3/bin/python", "-m", "muninn_worker", "run", "--schedule", "22:00-07:00",
                         "--cache-dir", "/tmp/100%"], {"PYTHONUNBUFFERED": "1"})

    assert ('ExecStart="/opt/py 3/bin/python" -m muninn_worker run --schedule 22:00-07:00 --cache-dir /tmp/100%%\n'
            in unit)
    assert "Environment=PYTHONUNBUFFERED=1\n" in unit and "RestartPreventExitStatus=1 2 3\n" in unit
    assert "SuccessExitStatus=130\n" in unit
    assert unit.endswith("[Install]\nWantedBy=default.target\n")


def test_macos_and_windows_get_the_equivalent_printed(tmp_path):
    command = ["/usr/bin/python3", "-m", "muninn_worker", "run", "--config", "/Users/a b/c.json"]

    plist = plistlib.loads(launchd_plist(command, {"PYTHONUNBUFFERED": "1"}, log=tmp_path / "w.log").encode())
    mac = service_for("Darwin", command, {}, home=tmp_path)
    windows = schtasks_command([r"C:\Python 3\python.exe", "-m", "muninn_worker", "run"], {})

    assert plist["ProgramArguments"] == command and plist["RunAtLoad"] is True
    assert mac.path is None and "launchctl load -w" in mac.next_steps
    assert windows == (r'schtasks /Create /TN "Muninn worker" /SC ONLOGON /RL LIMITED /F '
                       r'/TR "\"C:\Python 3\python.exe\" -m muninn_worker run"')


@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA GPU")
def test_gpu_only_refuses_to_start_on_a_machine_without_cuda(tmp_path):
    config = tmp_path / "worker.json"
    config.write_text(json.dumps({"server": "http://127.0.0.1:9", "device_token": "t", "signing_key": new_private_key()}))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MUNINN_")}, "PYTHONPATH": str(PACKAGE_ROOT)}

    done = subprocess.run([sys.executable, "-m", "muninn_worker", "run", "--gpu-only", "--config", str(config)],
                          capture_output=True, text=True, timeout=60, env=env)

    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"muninn-worker: error: --gpu-only, but torch sees no CUDA GPU on this machine (torch {torch.__version__}, "
        f"{'built without CUDA' if torch.version.cuda is None else f'CUDA {torch.version.cuda}, but no GPU found'}); "
        "run without --gpu-only to lend the CPU"]
