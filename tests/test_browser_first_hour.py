"""A newcomer's first hour, in a real browser (Playwright driving Debian's chromium) against `make run` itself:
scripts/run.sh on its embedded defaults (SQLite, the filesystem broker, local media, no Stripe) with its one local
worker client, in a var/ folder of its own. A brand-new customer signs up, finds the demo credit on the balance,
uploads digits, accepts a quote and gets a trained model: no Stripe, no manual command. Staff credit the customer
from the site on the way. Screenshots go to var/screenshots/ with the other browser tests'."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from playwright import sync_api as playwright_sync
from playwright.sync_api import expect

from scripts.stack import ROOT, free_port

from .conftest import digits_npz

pytestmark = [pytest.mark.browser, pytest.mark.e2e]
CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = ROOT / "var" / "screenshots"
JOB_TIMEOUT_MS = 120_000


@pytest.fixture
def make_run(tmp_path):
    """`make run` (migrate, then scripts/run.sh) with nothing of the test's environment that it would not have."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"the browser tests drive {CHROMIUM}: apt-get install -y chromium (.ci/run does)")
    var, port = tmp_path / "var", free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "MUNINN_DEMO_CREDIT", "MEDIA_ROOT")
           and not k.startswith("STRIPE_")}
    env.update(MUNINN_VAR_DIR=str(var), MUNINN_PORT=str(port), MUNINN_PYTHON=sys.executable, PYTHONUNBUFFERED="1",
               PYTHONPATH=f"{ROOT / 'platform'}:{ROOT}")
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=env, check=True,
                   capture_output=True)
    out_path = tmp_path / "make-run.out"
    with open(out_path, "wb") as out:
        run = subprocess.Popen(["bash", "scripts/run.sh"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Muninn is running" not in out_path.read_text():
            assert run.poll() is None and time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", var, out_path
    finally:
        run.send_signal(signal.SIGTERM)  # as Ctrl-C: run.sh's trap stops its processes
        try:
            run.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()


def shot(page, name: str) -> None:
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def log_tail(var: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted((var / "log").glob("*.log")))


def test_a_new_customer_trains_a_model_on_make_runs_defaults_paid_by_the_demo_credit(make_run, tmp_path):
    url, var, out_path = make_run
    assert "New customers who sign up get a 100.00 demo credit" in out_path.read_text()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    digits = tmp_path / "digits.npz"
    digits.write_bytes(digits_npz())
    with playwright_sync.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        context = chromium.new_context(base_url=url, viewport={"width": 1280, "height": 900}, accept_downloads=True)
        context.set_default_timeout(30_000)
        page = context.new_page()

        # Sign up: a brand-new customer, and the demo credit is there.
        page.goto("/signup/")
        page.fill("#id_username", "newcomer")
        page.fill("#id_email", "newcomer@example.com")
        page.check("input[name=role][value=customer]")
        page.fill("#id_password1", "a-long-pass-phrase")
        page.fill("#id_password2", "a-long-pass-phrase")
        page.click("button[type=submit]:has-text('Create my account')")
        page.wait_for_url("**/jobs/")
        page.goto("/balance/")
        assert "€100.00" in page.inner_text("#balances")
        assert "demo credit on sign-up" in page.inner_text("#statement")
        assert page.locator("#topup-disabled").is_visible()  # no Stripe here, and nothing else needed
        shot(page, "first-hour-balance")

        # Upload, quote, accept: the make run's local worker client is the capable device online.
        page.goto("/datasets/")
        page.set_input_files("#id_file", str(digits))
        page.click("#upload-button")
        page.wait_for_url(re.compile(r".*/datasets/\d+/$"))
        page.click("text=Train a model on it")
        page.wait_for_selector("#quote-figures:not([hidden])")
        assert page.input_value("#id_template") == "mlp" and page.inner_text("#quote-devices") == "1"
        if page.input_value("#id_rounds") != "2":  # two rounds keep it short; the quote follows the form
            quoted = page.inner_text("#quote-hu")
            page.fill("#id_rounds", "2")
            # Locators, not wait_for_function: the site's Content-Security-Policy refuses a string evaluated in it.
            expect(page.locator("#quote-hu")).not_to_have_text(quoted, timeout=30_000)
            expect(page.locator("#accept-button")).to_be_enabled(timeout=30_000)
        shot(page, "first-hour-new-job")
        page.click("#accept-button")
        page.wait_for_url(re.compile(r".*/jobs/\d+/$"))
        assert "started" in page.inner_text(".messages")

        # Meanwhile staff credit the newcomer from the site: audited, on the statement.
        staff = chromium.new_context(base_url=url).new_page()
        staff.goto("/login/")
        staff.fill("#id_username", "staff")
        staff.fill("#id_password", "muninn-staff")
        staff.click("button[type=submit]")
        staff.wait_for_url("**/staff/")
        staff.click("#credit-link")
        staff.fill("#id_customer", "newcomer")
        staff.fill("#id_amount", "5.00")
        staff.fill("#id_reason", "welcome: first job on the house")
        staff.click("#credit-button")
        assert "Credited €5.00 to newcomer" in staff.inner_text(".messages")
        assert "welcome: first job on the house" in staff.inner_text("#credits")
        shot(staff, "staff-credit")

        # The job trains on the local worker; the page offers the model.
        try:
            page.wait_for_selector("#download-model", timeout=JOB_TIMEOUT_MS)
        except playwright_sync.TimeoutError:
            pytest.fail(f"the job did not finish: {page.inner_text('main')[:1500]}\n{log_tail(var)}")
        assert page.inner_text("#job-status") == "Succeeded"
        assert page.inner_text("#job-metric").startswith("test accuracy 0.")
        shot(page, "first-hour-job-done")
        with page.expect_download() as download:
            page.click("#download-model")
        path = tmp_path / "model.safetensors"
        download.value.save_as(path)
        header_len = int.from_bytes(path.read_bytes()[:8], "little")
        assert b'"muninn_template":"mlp"' in path.read_bytes()[8:8 + header_len]
        page.goto("/balance/")
        assert "welcome: first job on the house" in page.inner_text("#statement")
        chromium.close()
    assert "ended with exit code" not in out_path.read_text()  # every process of make run lived through it
