"""The console script, run as a user would: in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from muninn_worker.signing import new_private_key

SCRIPT = Path(sys.executable).with_name("muninn-worker")


def _cli(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    assert SCRIPT.exists(), "install the package first: pip install -e worker_client --no-deps"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**_clean_env(), **(env or {})})


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUNINN_")}
    env["MUNINN_WORKER_CONFIG"] = "/nonexistent/muninn-worker-test/config.json"
    return env


def _one_sentence(stderr: str) -> None:
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


@pytest.mark.parametrize("args", [
    ["--bogus"],
    ["run", "--max-units", "zero"],
    ["run", "--max-units", "0"],
    ["run", "--exit-when-idle", "-1"],
    ["run", "--poll-interval", "0"],
    ["register", "--nope"],
    ["teleport"],
    [],
])
def test_bad_flags_exit_2_with_one_sentence(args):
    result = _cli(*args)

    assert result.returncode == 2
    _one_sentence(result.stderr)
    assert result.stderr.startswith("muninn-worker: error:")


def test_run_without_a_registered_device_says_how_to_register(tmp_path):
    result = _cli("run", "--config", str(tmp_path / "config.json"))

    assert result.returncode == 2
    _one_sentence(result.stderr)
    assert "no device registered: run `muninn-worker register --server URL --token T` first" in result.stderr


def test_broken_config_file_exits_2(tmp_path):
    (tmp_path / "config.json").write_text("not json")

    result = _cli("run", "--config", str(tmp_path / "config.json"))

    assert result.returncode == 2
    _one_sentence(result.stderr)


def test_register_without_a_token_exits_2(tmp_path):
    result = _cli("register", "--server", "http://127.0.0.1:9", "--config", str(tmp_path / "c.json"))

    assert result.returncode == 2 and "MUNINN_TOKEN" in result.stderr


def test_register_then_run_processes_a_unit(fake_site, tmp_path):
    config = tmp_path / "config.json"
    fake_site.add_unit(samples=64)

    registered = _cli("register", "--server", fake_site.url, "--name", "ci-box", "--config", str(config),
                      env={"MUNINN_TOKEN": fake_site.account_token})
    ran = _cli("run", "--exit-when-idle", "0", "--threads", "1", "--cache-dir", str(tmp_path / "cache"),
               env={"MUNINN_WORKER_CONFIG": str(config)})

    assert registered.returncode == 0, registered.stderr
    assert "registered device 7" in registered.stdout
    saved = json.loads(config.read_text())
    assert saved["device_token"] == fake_site.device_token and saved["server"] == fake_site.url
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert ran.returncode == 0, ran.stderr
    assert "claimed unit 42" in ran.stderr and "accepted" in ran.stderr
    assert len(fake_site.results) == 1


def test_register_with_a_wrong_token_exits_1(fake_site, tmp_path):
    result = _cli("register", "--server", fake_site.url, "--token", "wrong", "--config", str(tmp_path / "c.json"))

    assert result.returncode == 1
    assert "Invalid account token." in result.stderr and "Traceback" not in result.stderr


def test_ctrl_c_exits_130_with_a_message(fake_site, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"server": fake_site.url, "device_token": fake_site.device_token,
                                  "signing_key": new_private_key()}))
    # Ctrl-C as at a terminal: a suite started in the background by a non-interactive shell has SIGINT ignored,
    # which its children inherit (and Python then installs no KeyboardInterrupt handler).
    process = subprocess.Popen([str(SCRIPT), "run", "--config", str(config)], env=_clean_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for_claims(fake_site, process)

    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=30)

    assert process.returncode == 130
    assert "interrupted" in stderr and "Traceback" not in stderr


def _wait_for_claims(site, process: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not any(path.endswith("/claim") for _, path in site.requests):
        assert process.poll() is None and time.monotonic() < deadline, "the worker never polled"
        time.sleep(0.05)


def test_run_with_a_config_that_has_no_signing_key_says_to_register_again(fake_site, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"server": fake_site.url, "device_token": fake_site.device_token}))

    result = _cli("run", "--config", str(config))

    assert result.returncode == 2
    assert "no signing key" in result.stderr and "register" in result.stderr and "Traceback" not in result.stderr


def test_probe_prints_capabilities_json():
    result = _cli("probe")

    assert result.returncode == 0, result.stderr
    capabilities = json.loads(result.stdout)
    assert "cpu" in capabilities["backends"] and capabilities["cpu_cores"] >= 1
    assert capabilities["samples_per_s"] > 0 and capabilities["flops_per_s"] > 0


def test_python_dash_m_works():
    result = subprocess.run([sys.executable, "-m", "muninn_worker", "--version"], capture_output=True, text=True)

    assert result.returncode == 0 and result.stdout.startswith("muninn-worker ")
