"""The browser tier end to end: a contributor opens /contribute/browser/ in chromium, the page registers the
browser as a device and trains units of a real job in its Web Worker beside a Python `muninn-worker` process;
the job finishes, the browser's units are verified by the site's segment checks and credited, and its earnings
show on the page (screenshot in var/screenshots/). A browser whose JavaScript was altered to scale its updates is
refused as any cheater is. Live processes (the web server, a Celery worker on Redis) on the test's PostgreSQL."""
from __future__ import annotations

import os
import time

import pytest
from django.utils import timezone
from playwright import sync_api as playwright_sync

from accounts import services as accounts
from accounts.models import User
from billing import money
from billing import selectors as ledger
from billing import services as billing
from billing.models import Account
from contributors import browser as browser_tier
from contributors import tolerances
from contributors.models import Device, DeviceEvent, Receipt
from jobs.models import Job, WorkUnit
from scripts.stack import ROOT, free_port

from .conftest import digits_npz
from .test_e2e import customer_session, live_stack, wait_until_ended, wait_until_polling

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
CHROMIUM = "/usr/bin/chromium"
SCREENSHOTS = ROOT / "var" / "screenshots"
PASSWORD = "a-long-pass-phrase"


@pytest.fixture
def stack(tmp_path):
    """The site's processes on the test's database, pricing work high enough that a small job's earnings show
    in cents (as tests/test_browser.py does)."""
    with live_stack(tmp_path, MUNINN_PRICE_PER_HU="100000000") as running:
        yield running


@pytest.fixture
def market(db) -> dict[str, User]:
    staff = accounts.user_create(username="ops", password="ops-pass-123", role=User.Role.STAFF)
    customer = accounts.user_create(username="carol", password="carol-pass-123", role=User.Role.CUSTOMER)
    billing.balance_grant(user=customer, amount=money.to_nanos("5"), reason="browser e2e credit", granted_by=staff)
    return {"customer": customer,
            **{name: accounts.user_create(username=name, password=PASSWORD, role=User.Role.CONTRIBUTOR)
               for name in ("dave", "erin", "mallory")}}


@pytest.fixture
def chromium(monkeypatch):
    # Playwright's sync API keeps an event loop on this thread; the test's ORM queries are plain blocking ones.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "1")
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"the browser tests drive {CHROMIUM}: apt-get install -y chromium (.ci/run does)")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with playwright_sync.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


def open_contribute_page(chromium, url: str, username: str, *, alter_js=None):
    """A fresh browser profile signed in as `username` on /contribute/browser/. `alter_js(path, source)` may
    rewrite any of the page's scripts on their way in, the Web Worker's modules included."""
    context = chromium.new_context(base_url=url, viewport={"width": 1200, "height": 1000})
    context.set_default_timeout(30_000)
    if alter_js is not None:
        def altered(route):
            answer = route.fetch()
            path = route.request.url.split("/static/", 1)[1]
            route.fulfill(response=answer, body=alter_js(path, answer.text()))
        context.route("**/static/muninn/browser/*.js", altered)
    console = []  # what the page and its worker said: shown when a wait runs out
    context.on("console", lambda m: console.append(m.text))
    context.on("weberror", lambda e: console.append(f"error: {e.error}"))
    page = context.new_page()
    page.goto("/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url("**/contribute/")
    page.goto("/contribute/browser/")
    page.console = console
    return page


def page_state(page) -> str:
    return page.inner_text("#browser-contributor") + "\n" + "\n".join(page.console[-20:])


def wait_for_browser_device(page, owner: User, since, timeout: float = 60) -> Device:
    deadline = time.monotonic() + timeout
    while True:
        device = Device.objects.filter(owner=owner, last_seen_at__gte=since).first()
        if device is not None:
            return device
        assert time.monotonic() < deadline, "the page did not register the browser and claim:\n" + page_state(page)
        page.wait_for_timeout(300)  # not time.sleep: Playwright answers the page's routed requests meanwhile


def start_job(url: str, customer: User, *, rounds: int) -> dict:
    api = customer_session(customer)
    dataset = api.post(f"{url}/api/datasets", files={"file": ("digits.npz", digits_npz(600))}).json()
    job = api.post(f"{url}/api/jobs", json={"dataset": dataset["id"], "template": "mlp", "rounds": rounds,
                                            "seed": 5, "hparams": {"hidden": [32]}, "start": True}).json()
    assert "id" in job, job
    return job


def test_a_browser_trains_units_of_a_job_beside_a_python_worker_and_is_credited(stack, market, chromium):
    url = stack.web(free_port())
    stack.celery_worker()
    config = stack.register_device(url, accounts.token_for(user=market["dave"]), "python-device")
    started = timezone.now()
    stack.worker_client("python-device", config, "--threads", "1", "--poll-interval", "0.2")
    page = open_contribute_page(chromium, url, "erin")
    browser_device = wait_for_browser_device(page, market["erin"], started)
    wait_until_polling(["python-device"], started)

    job = wait_until_ended(customer_session(market["customer"]), url, start_job(url, market["customer"], rounds=2))
    logs = "\n".join(f"--- {n}\n{stack.log(n)[-3000:]}" for n in ("web", "celery-worker", "python-device"))
    assert job["status"] == "succeeded", logs + page_state(page)

    browser_device.refresh_from_db()
    assert browser_device.capabilities["backends"] == ["browser"]
    accepted = Receipt.objects.filter(unit__round__job_id=job["id"], device=browser_device, status="accepted")
    assert accepted.exists(), page_state(page)
    for receipt in accepted:  # verified by re-training its drawn segments, at the browser's tolerance
        check = receipt.verification["segment_check"]
        assert check["passed"] is True and check["validator"] == "site:cpu", check
        assert check["tolerance"] == tolerances.tolerance("mlp", receipt.segment_steps, backend="browser")
        assert all(s["distance"] <= check["tolerance"] for s in check["segments"]), check
    assert Receipt.objects.filter(unit__round__job_id=job["id"], device__name="python-device",
                                  status="accepted").exists()
    assert not Receipt.objects.filter(device=browser_device, status="rejected").exists()

    def credited() -> int:
        return ledger.balances_for(user=market["erin"]).get(Account.Kind.CONTRIBUTOR_PENDING, 0)

    # Each accepted unit's charge posts moments after its check; the page follows /api/worker/me.
    deadline = time.monotonic() + 40
    while not (Receipt.objects.filter(device=browser_device, credit_pending=True).count() == 0 and credited() > 0
               and page.inner_text("#earnings-pending") == money.format_money(credited(), "EUR")
               and page.get_attribute("#browser-contributor", "data-verified") == str(accepted.count())):
        assert time.monotonic() < deadline, (page.inner_text("#earnings-pending"), credited(), page_state(page))
        time.sleep(0.5)
    assert page.inner_text("#earned-today").startswith("€") and page.inner_text("#earned-today") != "€0.00"
    assert int(page.inner_text("#units-done")) >= 1
    page.screenshot(path=str(SCREENSHOTS / "contribute-browser.png"), full_page=True)
    assert not [m for m in page.console if "Content Security Policy" in m], page.console
    assert Job.objects.get(pk=job["id"]).status == "succeeded"


def scale_updates(path: str, source: str) -> str:
    """The cheat: every SGD step moves the weights 1.5 times as far as it should."""
    if path.endswith("browser/mlp.js"):
        altered = source.replace("p[j] = p[j] - lr * vj;", "p[j] = p[j] - 1.5 * lr * vj;")
        assert altered != source
        return altered
    return source


def test_a_browser_whose_script_scales_its_updates_is_refused(stack, market, chromium):
    url = stack.web(free_port())
    stack.celery_worker()
    started = timezone.now()
    page = open_contribute_page(chromium, url, "mallory", alter_js=scale_updates)
    device = wait_for_browser_device(page, market["mallory"], started)

    start_job(url, market["customer"], rounds=1)
    deadline = time.monotonic() + 90
    while not Receipt.objects.filter(device=device, status="rejected").exists():
        assert time.monotonic() < deadline, page_state(page) + stack.log("web")[-3000:]
        page.wait_for_timeout(500)

    refused = Receipt.objects.get(device=device, status="rejected")
    device.refresh_from_db()
    page.unroute_all(behavior="ignoreErrors")
    assert refused.reason.startswith("reexecution_mismatch"), refused.reason
    assert device.failures >= 1 and device.verified_total == 0
    assert ledger.balances_for(user=market["mallory"]).get(Account.Kind.CONTRIBUTOR_PENDING, 0) == 0
    check = refused.verification["segment_check"]
    assert check["passed"] is False
    assert check["tolerance"] == tolerances.tolerance("mlp", refused.segment_steps, backend=browser_tier.BACKEND)
    assert max(s["distance"] for s in check["segments"]) > 100 * check["tolerance"], check


def test_closing_the_tab_gives_back_the_unit_in_hand(stack, market, chromium):
    url = stack.web(free_port())
    stack.celery_worker()
    started = timezone.now()
    page = open_contribute_page(chromium, url, "erin")
    device = wait_for_browser_device(page, market["erin"], started)
    held = []  # the shard's download never answers: the unit stays in the tab's hands
    page.context.route("**/api/worker/units/*/shard", lambda route: held.append(route))

    job = start_job(url, market["customer"], rounds=1)
    deadline = time.monotonic() + 60
    while not held:
        assert time.monotonic() < deadline, page_state(page)
        page.wait_for_timeout(200)
    unit = WorkUnit.objects.get(round__job_id=job["id"], status=WorkUnit.Status.LEASED, leased_device_id=device.pk)

    page.close()  # the tab closes: its pagehide gives the unit back (a keepalive request outlives the page)

    deadline = time.monotonic() + 10  # well inside the 30 s lease: only the give-back queues it this soon
    while WorkUnit.objects.get(pk=unit.pk).status != WorkUnit.Status.QUEUED:
        assert time.monotonic() < deadline, stack.log("web")[-3000:]
        time.sleep(0.2)
    assert not DeviceEvent.objects.filter(device=device, kind=DeviceEvent.Kind.ABANDONED).exists()
