"""A worker client older than the site speaks to is told so (426 client_too_old, with its upgrade command) on
every worker endpoint, and the real client prints that and stops instead of failing on a field it does not know."""
from __future__ import annotations

import subprocess
import sys

import pytest
from rest_framework.test import APIClient

from accounts import services as accounts
from contributors import install

from .conftest import register_device

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("header", [{"HTTP_USER_AGENT": "muninn-worker/0.1.0 python-requests/2.32"},
                                    {"HTTP_MUNINN_CLIENT_VERSION": "0.1.0"}])
def test_a_client_older_than_the_site_supports_gets_426_with_the_upgrade(contributor, settings, header):
    settings.MUNINN_MIN_WORKER_VERSION = "0.2.0"
    register_device(contributor)
    api = APIClient()

    for path in ("/api/worker/claim", "/api/worker/devices", "/api/worker/units/1/heartbeat"):
        answer = api.post(path, {}, format="json", **header)
        assert answer.status_code == 426, path
        error = answer.json()["error"]
        assert error["code"] == "client_too_old" and error["detail"] == {
            "minimum": "0.2.0", "version": "0.1.0", "upgrade": install.upgrade("http://testserver")}
        assert install.upgrade("http://testserver") in error["message"]


def test_a_current_client_or_one_that_names_no_version_is_served(contributor, settings):
    settings.MUNINN_MIN_WORKER_VERSION = "0.2.0"
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {accounts.token_for(user=contributor)}")

    for header in ({"HTTP_USER_AGENT": "muninn-worker/0.10.0"}, {"HTTP_MUNINN_CLIENT_VERSION": "0.2.0"}, {}):
        answer = api.post("/api/worker/claim", {}, format="json", **header)
        assert answer.status_code == 401  # past the version gate: an account token is no device's


@pytest.mark.django_db(transaction=True)
def test_the_worker_client_prints_the_upgrade_and_exits(contributor, settings, live_server, tmp_path):
    config = tmp_path / "worker.json"
    command = [sys.executable, "-m", "muninn_worker"]
    registered = subprocess.run([*command, "register", "--server", live_server.url, "--token",
                                 accounts.token_for(user=contributor), "--name", "old", "--config", str(config)],
                                capture_output=True, text=True, timeout=120)
    assert registered.returncode == 0, registered.stderr
    settings.MUNINN_MIN_WORKER_VERSION = "99.0"  # the site moved on

    run = subprocess.run([*command, "run", "--config", str(config), "--cache-dir", str(tmp_path / "cache"),
                          "--max-units", "1"], capture_output=True, text=True, timeout=120)

    assert run.returncode == 3, run.stderr
    assert "needs muninn-worker 99.0 or newer" in run.stderr and install.upgrade(live_server.url) in run.stderr
    assert "Traceback" not in run.stderr
