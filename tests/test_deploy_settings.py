"""The settings a deployment gets by default are safe: DEBUG off unless set, and with DEBUG off, secure cookies,
HSTS and HTTPS redirects (muninn/settings.py), so `manage.py check --deploy` finds no issue."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _check_deploy(tmp_path, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "SECRET_KEY", "MUNINN_TLS")}
    return subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"], cwd=ROOT,
                          env={**clean, "MUNINN_VAR_DIR": str(tmp_path), "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}",
                               **env}, capture_output=True, text=True, timeout=120)


def test_production_like_settings_pass_check_deploy(tmp_path):
    out = _check_deploy(tmp_path, SECRET_KEY=secrets.token_urlsafe(50), ALLOWED_HOSTS="muninn.example")

    # No issue at all: no security warning, and no drf-spectacular warning (every API view is described in the
    # OpenAPI schema: tests/test_openapi.py)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "System check identified no issues (0 silenced)." in out.stdout, out.stdout + out.stderr
    issues = [line for line in out.stdout.splitlines() + out.stderr.splitlines() if line.startswith("?:")]
    assert issues == [], "\n".join(issues)


def test_debug_is_off_unless_set_and_then_a_secret_key_is_required(tmp_path):
    out = _check_deploy(tmp_path, ALLOWED_HOSTS="muninn.example")

    assert out.returncode != 0 and "SECRET_KEY must be set when DEBUG is off" in out.stderr


def test_a_site_on_plain_http_turns_tls_off_explicitly(tmp_path):
    code = ("from django.conf import settings as s; print(s.DEBUG, s.SECURE_SSL_REDIRECT, s.SESSION_COOKIE_SECURE, "
            "s.SECURE_HSTS_SECONDS)")
    env = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "MUNINN_TLS")}
    run = lambda **extra: subprocess.run(  # noqa: E731
        [sys.executable, "manage.py", "shell", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**env, "MUNINN_VAR_DIR": str(tmp_path), "SECRET_KEY": "x" * 50,
             "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}", **extra}).stdout.splitlines()[-1].split()
    assert run() == ["False", "True", "True", "31536000"]
    assert run(MUNINN_TLS="false") == ["False", "False", "False", "0"]  # `make run` on localhost
