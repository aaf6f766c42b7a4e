"""The web UI in a real browser (Playwright driving Debian's chromium) against a live site: the web server, a Celery
worker on Redis and two `muninn-worker` processes on the test's PostgreSQL database, with Stripe played by the
local fake (tests/fake_stripe.py) and its hosted pages answered by the browser's request routing.

The tests run in order and share one live site: a contributor signs up and registers two devices with the
command the page shows; a customer signs up, tops up, uploads digits, gets a quote, starts a job the devices
train, watches the chart fill in and downloads the model; the contributor sees the earnings and asks for a
payout; staff approve it. A screenshot of each main page goes to var/screenshots/."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
import requests
from django.conf import settings
from muninn_worker import load_model
from playwright import sync_api as playwright_sync  # in the dev extras: pip install -e ".[dev]"
from playwright.sync_api import expect
from sklearn.datasets import load_digits

from muninn.celery import app as celery_app
from scripts.stack import ROOT, VENV_BIN, Stack, base_env, free_port

from .conftest import digits_npz
from .fake_stripe import WEBHOOK_SECRET, event, signed


pytestmark = [pytest.mark.browser, pytest.mark.e2e]
CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = ROOT / "var" / "screenshots"
JOB_TIMEOUT_MS = 150_000
PRICE_PER_HU = "100000000"  # €10^8 per HU: a 3-round digits MLP costs a few euros, so the money shows in cents


@dataclass
class Live:
    stack: Stack
    url: str
    fake: object
    tmp: Path
    state: dict = field(default_factory=dict)  # what one test leaves the next (the journey goes in order)

    def webhook(self, type_: str, obj: dict) -> None:
        """What Stripe does after its hosted page: a signed event to the site's webhook."""
        body, header = signed(event(type_, obj), secret=WEBHOOK_SECRET)
        answer = requests.post(f"{self.url}/api/stripe/webhook", data=body, timeout=30,
                               headers={"Content-Type": "application/json", "Stripe-Signature": header})
        assert answer.status_code == 200 and answer.json()["status"] == "processed", answer.text


@contextmanager
def own_database():
    """A database of the live site's own, migrated by the site, dropped afterwards: the site's processes and the
    browser share it, and no other test's transactions or flushes touch it."""
    db = settings.DATABASES["default"]
    if db["ENGINE"] != "django.db.backends.postgresql" or not settings.CELERY_BROKER_URL.startswith("redis://"):
        pytest.fail("the browser tests need PostgreSQL and Redis: run them through `make test`")
    name = f"test_{db['NAME']}_browser"
    params = {"host": db["HOST"] or "127.0.0.1", "port": db["PORT"] or 5432, "user": db["USER"],
              "password": db["PASSWORD"] or None, "dbname": "postgres", "autocommit": True}
    with psycopg.connect(**params) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgres://{db['USER']}@{params['host']}:{params['port']}/{name}"
    finally:
        with psycopg.connect(**params) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def live(_fake_stripe_server, tmp_path_factory):
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"the browser tests drive {CHROMIUM}: apt-get install -y chromium (.ci/run does)")
    tmp = tmp_path_factory.mktemp("browser")
    celery_app.conf.task_always_eager = False
    with celery_app.connection_for_write() as conn:  # drop messages a previous run may have left behind
        for queue in ("celery", "validation"):
            conn.default_channel.queue_purge(queue)
    port = free_port()
    _fake_stripe_server.reset()
    with own_database() as database_url:
        env = base_env(DATABASE_URL=database_url, CELERY_BROKER_URL=settings.CELERY_BROKER_URL,
                       MEDIA_ROOT=str(tmp / "media"), MUNINN_VAR_DIR=str(tmp / "var"), DEBUG="1", LOG_LEVEL="INFO",
                       MUNINN_SITE_URL=f"http://127.0.0.1:{port}", MUNINN_LEASE_SECONDS="30",
                       MUNINN_PRICE_PER_HU=PRICE_PER_HU, MUNINN_PAYOUT_MIN="1.00", MUNINN_EARNINGS_HOLD_SECONDS="0",
                       STRIPE_SECRET_KEY=_fake_stripe_server.secret_key, STRIPE_WEBHOOK_SECRET=WEBHOOK_SECRET,
                       STRIPE_API_BASE=_fake_stripe_server.base_url)
        with Stack(env=env, log_dir=tmp / "log") as stack:
            stack.manage("migrate", "--noinput")
            url = stack.web(port)
            stack.celery_worker()
            yield Live(stack=stack, url=url, fake=_fake_stripe_server, tmp=tmp)


@pytest.fixture(scope="module")
def browser(live):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with playwright_sync.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def new_page(browser, live: Live):
    """A fresh browser profile (its own cookies). Stripe's hosted pages, at their real addresses (which the site's
    Content-Security-Policy must let its forms redirect to), are answered locally: the site only redirects to
    them, and nothing here may reach the internet."""
    context = browser.new_context(base_url=live.url, viewport={"width": 1280, "height": 900}, accept_downloads=True)
    context.set_default_timeout(30_000)
    for host in ("checkout.stripe.com", "connect.stripe.com"):
        context.route(f"https://{host}/**", lambda route: route.fulfill(
            status=200, content_type="text/html", body=f"<h1>Stripe (fake) at {route.request.url}</h1>"))
    # Chromium reports what the Content-Security-Policy blocked (a script, a style, a form's target) on the console.
    violations = live.state.setdefault("csp_violations", [])
    context.on("console", lambda message: violations.append(f"{message.page.url}: {message.text}")
               if "Content Security Policy" in message.text else None)
    return context.new_page()


def quoted_euros(page) -> float:
    """The quote's price in euros, as the page shows it."""
    return float(re.sub(r"[^0-9.]", "", page.locator("#quote-price").text_content()) or "nan")


def wait_for_quote(page, fits) -> None:
    """Wait until the page offers a quote whose price fits (it follows the form after a short delay). Polled from
    here: page.wait_for_function would evaluate a string in the page, which the site's Content-Security-Policy
    (no 'unsafe-eval') refuses, as it should."""
    deadline = time.monotonic() + 30
    while not (page.locator("#accept-button").is_enabled() and fits(quoted_euros(page))):
        assert time.monotonic() < deadline, page.locator("#quote").inner_text()
        time.sleep(0.1)


def shot(page, name: str) -> None:
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def sign_up(page, username: str, role: str) -> None:
    page.goto("/signup/")
    page.fill("#id_username", username)
    page.fill("#id_email", f"{username}@example.com")
    page.check(f"input[name=role][value={role}]")
    page.fill("#id_password1", "a-long-pass-phrase")
    page.fill("#id_password2", "a-long-pass-phrase")
    page.click("button[type=submit]:has-text('Create my account')")


def test_contributor_registers_devices_with_the_command_on_the_page(live, browser):
    page = new_page(browser, live)
    sign_up(page, "dora", "contributor")
    page.wait_for_url("**/contribute/")

    command = shlex.split(page.inner_text("#register-command"))
    assert command[:2] == ["muninn-worker", "register"] and command[command.index("--server") + 1] == live.url
    started = []
    for name in ("laptop", "desktop"):
        config = live.tmp / f"{name}.json"
        args = [str(VENV_BIN / "muninn-worker"), *command[1:command.index("--name")], "--name", name,
                "--config", str(config)]
        out = subprocess.run(args, env=live.stack.env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        started.append(live.stack.worker_client(name, config, "--threads", "1", "--poll-interval", "0.2"))
    deadline = time.monotonic() + 90
    while page.locator("#devices .status.online").count() < 2:  # both processes have asked for work
        assert time.monotonic() < deadline, live.stack.log("laptop")[-2000:]
        time.sleep(1)
        page.reload()

    assert page.locator("#devices tr[data-device=laptop]").inner_text().count("cpu") >= 1
    shot(page, "contributor-devices")
    live.state["contributor_page"] = page


def test_customer_tops_up_uploads_gets_a_quote_runs_a_job_and_downloads_the_model(live, browser):
    page = new_page(browser, live)
    # An empty form says what is missing.
    page.goto("/signup/")
    page.click("button[type=submit]:has-text('Create my account')")
    assert page.locator("ul.errorlist[data-field=username]").inner_text() == "This field is required."
    shot(page, "signup-errors")
    sign_up(page, "carol", "customer")
    page.wait_for_url("**/jobs/")

    # Top up €20 through Stripe Checkout (the fake), credited by the signed webhook.
    answer = page.goto("/balance/")
    assert "script-src 'self'; style-src 'self'" in answer.headers["content-security-policy"]
    page.fill("#id_amount", "20.00")
    page.click("#topup-button")
    page.wait_for_url("https://checkout.stripe.com/**")
    session_id = page.url.rsplit("/", 1)[1]
    created = live.fake.calls("/v1/checkout/sessions")[-1].params
    live.webhook("checkout.session.completed", {
        "id": session_id, "object": "checkout.session", "payment_status": "paid", "status": "complete",
        "amount_total": int(created["line_items"]["0"]["price_data"]["unit_amount"]), "currency": "eur"})
    page.goto(created["success_url"])
    assert "was received and credited" in page.inner_text("#topup-result")
    assert "€20.00" in page.inner_text("#balances") and "Top-up" in page.inner_text("#statement")
    shot(page, "balance")

    # A file that is not valid data: the message says what is wrong and where.
    bad = live.tmp / "bad.csv"
    bad.write_text("pixels,label\n0.5,1\n0.7\n")
    page.goto("/datasets/")
    assert page.inner_text("#upload-limit") == "50.0\xa0MB"
    page.set_input_files("#id_file", str(bad))
    page.click("#upload-button")
    error = page.locator("#upload-error-message")
    error.wait_for()
    assert "row 3 has 1 fields but the header has 2" in error.inner_text() and "row: 3" in error.inner_text()
    shot(page, "upload-error")

    digits = live.tmp / "digits.npz"
    digits.write_bytes(digits_npz())
    page.set_input_files("#id_file", str(digits))
    page.click("#upload-button")
    page.wait_for_url(re.compile(r".*/datasets/\d+/$"))
    assert page.inner_text("#profile-rows") == "1797" and "10" in page.inner_text("#profile")
    shot(page, "dataset")

    # The quote follows the form; a job over the balance is refused on the page.
    page.click("text=Train a model on it")
    page.wait_for_selector("#quote-figures:not([hidden])")
    assert page.input_value("#id_template") == "mlp" and page.inner_text("#quote-devices") == "2"
    page.fill("#id_rounds", "200")
    wait_for_quote(page, lambda euros: euros > 20)
    page.click("#accept-button")
    refusal = page.locator("#quote-error-message")
    refusal.wait_for()
    assert "but your balance is €20.00. Top up and try again." in refusal.inner_text()
    shot(page, "job-over-balance")
    page.fill("#id_rounds", "3")
    wait_for_quote(page, lambda euros: euros < 20)
    quote = {k: page.inner_text(f"#quote-{k}") for k in ("hu", "price", "tier", "time", "devices")}
    assert quote["tier"].startswith("S") and quote["devices"] == "2" and quote["time"].startswith("about")
    shot(page, "new-job")
    page.click("#accept-button")
    page.wait_for_url(re.compile(r".*/jobs/\d+/$"))
    assert "started" in page.inner_text(".messages")

    # The chart fills in round by round; then the page offers the model.
    expect(page.locator("#job-chart")).to_have_attribute("data-points", re.compile(r"^[1-9]"), timeout=JOB_TIMEOUT_MS)
    shot(page, "job-running")
    page.wait_for_selector("#download-model", timeout=JOB_TIMEOUT_MS)
    expect(page.locator("#job-chart")).to_have_attribute("data-points", "3", timeout=30_000)
    assert page.inner_text("#job-status") == "Succeeded"
    assert page.locator("#rounds-body tr").count() == 3
    assert re.search(r"(laptop|desktop) #\d+\s+\d+", page.inner_text("#devices-body"))
    assert page.inner_text("#job-hu-used") == page.inner_text("#job-hu-quoted") != "0"
    assert page.inner_text("#job-metric").startswith("test accuracy 0.")
    shot(page, "job-done")
    with page.expect_download() as download:
        page.click("#download-model")
    path = live.tmp / "model.safetensors"
    download.value.save_as(path)
    assert download.value.suggested_filename.endswith("-mlp.safetensors") and path.stat().st_size > 1000
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert b'"muninn_template":"mlp"' in path.read_bytes()[8:8 + header_len]

    # Try the model on the page: two digits typed as CSV rows, answered as the downloaded package answers them.
    X, y = load_digits(return_X_y=True)
    header = page.input_value("#try-csv").strip()
    assert header == ",".join(f"x{j}" for j in range(64))
    rows = header + "\n" + "\n".join(",".join(str(int(v)) for v in X[i]) for i in (0, 1)) + "\n"
    page.fill("#try-csv", rows)
    page.click("#try-submit")
    page.wait_for_selector("#try-table")
    shown = [cell.inner_text() for cell in page.locator("#try-table .try-prediction").all()]
    assert shown == [p["label"] for p in load_model(path).predict(rows)]
    assert "%" in page.inner_text("#try-table")
    shot(page, "job-try-model")
    page.fill("#try-csv", header + "\n" + "1," * 63 + "seven\n")
    page.click("#try-submit")
    page.wait_for_selector("#try-error")
    assert "row 2, column 'x63'" in page.inner_text("#try-error")
    batch = live.tmp / "batch.csv"
    batch.write_text(header + "\n" + "\n".join(",".join(str(int(v)) for v in X[i]) for i in range(5)) + "\n")
    page.set_input_files("#batch-file", str(batch))
    page.click("#batch-submit")  # predicted in the background by the Celery worker; the page follows it
    page.wait_for_selector("#batch-download", timeout=60_000)
    with page.expect_download() as predictions:
        page.click("#batch-download")
    table = predictions.value.path().read_text().splitlines()
    assert table[0].startswith("row,prediction,p(0),p(1)") and len(table) == 6


def test_contributor_sees_earnings_sets_up_payouts_and_requests_one(live, browser):
    page = live.state.get("contributor_page")
    assert page is not None, "the contributor's test did not get as far as registering devices"
    page.goto("/contribute/")
    assert page.inner_text("[data-earnings=pending]") != "€0.00"
    # The holding period is 0 s on this site; the beat task that clears earnings runs (every 10 minutes):
    live.stack.manage("shell", "-c", "from billing.tasks import clear_earnings; print(clear_earnings())")
    page.goto("/contribute/")
    available = page.inner_text("[data-earnings=available]")
    assert available != "€0.00" and page.inner_text("[data-earnings=pending]") == "€0.00"

    page.click("#onboarding-button")
    page.wait_for_url("https://connect.stripe.com/**")
    account_id = page.url.split("/setup/e/")[1].split("/")[0]
    live.webhook("account.updated", {"id": account_id, "object": "account", "details_submitted": True,
                                     "payouts_enabled": True})
    page.goto("/contribute/?payouts=done")
    assert page.locator("#payout-account-ready").is_visible()

    page.fill("#id_amount", "1.00")
    page.click("#payout-button")
    assert "requested: staff review it" in page.inner_text(".messages")
    assert "Requested, waiting for review" in page.inner_text("#payouts")
    shot(page, "contributor-earnings")


def test_staff_approve_the_payout_from_the_review_queue(live, browser):
    live.stack.manage("seed_demo")  # staff accounts are made by staff; the demo one is "staff"
    page = new_page(browser, live)
    page.goto("/login/")
    page.fill("#id_username", "staff")
    page.fill("#id_password", "muninn-staff")
    page.click("button[type=submit]")
    page.wait_for_url("**/staff/")
    row = page.locator("#payout-queue tr[data-payout]")
    assert row.count() == 1 and "dora" in row.inner_text() and "€1.00" in row.inner_text()
    assert "2 devices" in row.inner_text() and "results accepted" in row.inner_text()
    shot(page, "staff-queue")

    row.get_by_role("link", name="Review").click()
    page.fill("input[name=reason]", "work verified")
    page.click("button[value=approve]")
    assert "Transferred" in page.inner_text(".messagelist")
    shot(page, "payout-review")
    assert len(live.fake.calls("/v1/transfers")) == 1

    contributor = live.state["contributor_page"]
    contributor.goto("/contribute/")
    assert "Transferred" in contributor.inner_text("#payouts")
    assert contributor.inner_text("[data-earnings='paid out']") == "€1.00"


def test_no_page_did_anything_the_content_security_policy_refused(live):
    """Every page above ran under the site's policy: none had an inline script, handler or style, loaded from
    elsewhere, or posted a form anywhere it does not allow."""
    assert "csp_violations" in live.state, "no page was opened"
    assert live.state["csp_violations"] == []
