"""The web UI's pages with Django's test client: who may see what, CSRF, and the forms' clear refusals. The
whole journey in a real browser is in tests/test_browser.py."""
from __future__ import annotations

import re

import pytest
from django.core import mail
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from accounts import services as accounts
from accounts.models import User
from billing import money
from billing.models import Quote, TopUp
from contributors.models import Device
from jobs import services as job_services
from jobs.models import Dataset, Job, WorkUnit

from .conftest import digits_npz, named_file, register_device

pytestmark = pytest.mark.django_db


def logged_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def customer_client(customer) -> Client:
    return logged_in(customer)


@pytest.fixture
def digits(customer_client) -> Dataset:
    response = customer_client.post("/datasets/", {"file": named_file(digits_npz(300), "digits.npz")})
    assert response.status_code == 302, response.content.decode()[:2000]
    return Dataset.objects.get()


CUSTOMER_PAGES = ["/jobs/", "/datasets/", "/jobs/new/"]
CONTRIBUTOR_PAGES = ["/contribute/"]
STAFF_PAGES = ["/staff/"]


@pytest.mark.parametrize("url", CUSTOMER_PAGES + CONTRIBUTOR_PAGES + STAFF_PAGES + ["/balance/"])
def test_anonymous_visitors_are_sent_to_the_login_page(url):
    response = Client().get(url)
    assert response.status_code == 302 and response["Location"].startswith("/login/?next=")


def test_each_role_sees_its_own_pages_and_is_refused_the_others(customer, contributor, staff):
    for user, mine in ((customer, CUSTOMER_PAGES + ["/balance/"]), (contributor, CONTRIBUTOR_PAGES + ["/balance/"]),
                       (staff, STAFF_PAGES)):
        client = logged_in(user)
        for url in CUSTOMER_PAGES + CONTRIBUTOR_PAGES + STAFF_PAGES:
            assert client.get(url).status_code == (200 if url in mine else 403), (user.role, url)


def test_a_customer_cannot_see_another_customers_job_or_dataset(customer, customer_client, digits, staff):
    other = accounts.user_create(username="mallory", password="mallory-pass-123", role=User.Role.CUSTOMER)
    quote = customer_client.post("/jobs/new/", {"dataset": digits.pk, "template": "mlp", "rounds": 1,
                                                "aggregation": "fedavg", "action": "quote"})
    quote_id = Quote.objects.get().pk
    started = customer_client.post("/jobs/new/", {"dataset": digits.pk, "template": "mlp", "rounds": 1,
                                                  "aggregation": "fedavg", "action": "accept", "quote": quote_id})
    job = Job.objects.get()
    assert quote.status_code == 200 and started.status_code == 302 and started["Location"] == f"/jobs/{job.pk}/"

    intruder = logged_in(other)
    for url in (f"/jobs/{job.pk}/", f"/jobs/{job.pk}/progress", f"/datasets/{digits.pk}/"):
        assert intruder.get(url).status_code == 404, url
    assert intruder.post(f"/jobs/{job.pk}/cancel").status_code == 404
    job.refresh_from_db()
    assert job.status == Job.Status.RUNNING
    assert customer_client.get(f"/jobs/{job.pk}/").status_code == 200


def test_forms_refuse_a_post_without_the_csrf_token(customer, contributor):
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(customer)
    assert strict.post("/datasets/", {"file": named_file(digits_npz(100), "d.npz")}).status_code == 403
    assert strict.post("/balance/topup", {"amount": "20.00"}).status_code == 403
    assert strict.post("/jobs/new/", {"action": "quote"}).status_code == 403
    assert Dataset.objects.count() == 0 and TopUp.objects.count() == 0
    page = strict.get("/datasets/").content.decode()
    assert 'name="csrfmiddlewaretoken"' in page


def test_signup_logs_the_new_customer_in_and_refuses_an_empty_form():
    client = Client()
    empty = client.post("/signup/", {})
    assert empty.status_code == 400 and "This field is required." in empty.content.decode()
    assert not User.objects.exists()

    created = client.post("/signup/", {"username": "erin", "email": "erin@example.com", "role": "contributor",
                                       "password1": "a-long-pass-phrase", "password2": "a-long-pass-phrase"})
    assert created.status_code == 302 and created["Location"] == "/contribute/"
    assert User.objects.get(username="erin").role == User.Role.CONTRIBUTOR
    assert client.get("/contribute/").status_code == 200


def test_signup_cannot_make_a_staff_account():
    response = Client().post("/signup/", {"username": "eve", "email": "eve@example.com", "role": "staff",
                                          "password1": "a-long-pass-phrase", "password2": "a-long-pass-phrase"})
    assert response.status_code == 400 and not User.objects.exists()


def test_password_reset_mails_a_link_that_sets_a_new_password(customer):
    customer.email = "alice@example.com"
    customer.save()
    client = Client()

    sent = client.post("/password-reset/", {"email": "alice@example.com"})
    assert sent.status_code == 302 and len(mail.outbox) == 1
    link = re.search(r"https?://[^/]+(/password-reset/\S+/)", mail.outbox[0].body).group(1)
    form = client.get(link, follow=True)
    done = client.post(form.redirect_chain[-1][0], {"new_password1": "a-brand-new-phrase",
                                                    "new_password2": "a-brand-new-phrase"})

    assert done.status_code == 302
    assert Client().login(username="alice", password="a-brand-new-phrase")


def test_upload_of_a_bad_file_shows_what_is_wrong_and_where(customer_client):
    bad = b"a,b,label\n1,2,x\n3,oops\n"
    response = customer_client.post("/datasets/", {"file": named_file(bad, "bad.csv")})
    page = response.content.decode()
    assert response.status_code == 400
    assert "row 3 has 2 fields but the header has 3" in page and "row: 3" in page
    assert Dataset.objects.count() == 0


def test_dataset_page_shows_the_profile(customer_client, digits):
    page = customer_client.get(f"/datasets/{digits.pk}/").content.decode()
    assert 'id="profile-rows">300<' in page and "Classes" in page and "classification" in page


def test_new_job_page_offers_templates_with_defaults_from_the_profile(customer_client, digits):
    page = customer_client.get(f"/jobs/new/?dataset={digits.pk}").content.decode()
    assert 'value="mlp" selected' in page
    # 300 rows → 240 for training → batch of at most a tenth of the rows: 30 (the template's default is 32)
    assert 'name="hp-mlp-batch_size" id="hp-mlp-batch_size" value="30"' in page


def test_new_job_quote_and_start_without_the_script(customer, customer_client, digits):
    form = {"dataset": digits.pk, "template": "mlp", "rounds": 2, "aggregation": "fedavg", "hp-mlp-hidden": "64, 32",
            "hp-mlp-epochs": "1"}
    quoted = customer_client.post("/jobs/new/", {**form, "action": "quote"})
    quote = Quote.objects.get()
    assert quoted.status_code == 200 and quote.hparams["hidden"] == [64, 32] and quote.rounds == 2
    assert f'value="{quote.pk}"' in quoted.content.decode()

    bad = customer_client.post("/jobs/new/", {**form, "hp-mlp-epochs": "many", "action": "quote"})
    assert bad.status_code == 400 and "epochs" in bad.content.decode() and Quote.objects.count() == 1


def test_a_job_over_the_balance_is_refused_with_a_message_and_nothing_changes(settings, customer, customer_client,
                                                                              digits):
    settings.MUNINN_PRICE_PER_HU = 10**12  # every job costs more than the customer's €10
    customer_client.post("/jobs/new/", {"dataset": digits.pk, "template": "mlp", "rounds": 3,
                                        "aggregation": "fedavg", "action": "quote"})
    quote = Quote.objects.get()
    response = customer_client.post("/jobs/new/", {"dataset": digits.pk, "template": "mlp", "rounds": 3,
                                                   "aggregation": "fedavg", "action": "accept", "quote": quote.pk})
    page = response.content.decode()
    assert response.status_code == 400
    assert f"This job costs {money.format_money(quote.price, exact=True)} but your balance is €10.00" in page
    assert Job.objects.count() == 0


def test_balance_page_says_when_stripe_is_not_configured(settings, customer_client):
    settings.STRIPE_SECRET_KEY = ""
    page = customer_client.get("/balance/").content.decode()
    assert "Stripe is not configured" in page and "€10.00" in page and "Manual credit" in page
    refused = customer_client.post("/balance/topup", {"amount": "20.00"}, follow=True)
    assert "Top-ups are disabled on this site" in refused.content.decode()


def test_topup_sends_the_customer_to_stripe_checkout(customer_client, fake_stripe):
    response = customer_client.post("/balance/topup", {"amount": "20.00"})
    assert response.status_code == 302 and response["Location"].startswith("https://checkout.stripe.com/")
    assert fake_stripe.calls("/v1/checkout/sessions")[0].params["success_url"].endswith(
        f"/balance/?topup={TopUp.objects.get().pk}")
    too_small = customer_client.post("/balance/topup", {"amount": "1.00"}, follow=True)
    assert "A top-up must be between €5.00 and €5,000.00." in too_small.content.decode()


def test_contributor_page_shows_the_register_command_with_their_token_and_their_devices(contributor):
    device = register_device(contributor, "garage-pc")
    Device.objects.filter(pk=device.pk).update(last_seen_at=None)
    page = logged_in(contributor).get("/contribute/").content.decode()
    token = accounts.token_for(user=contributor)
    assert f"muninn-worker register --server http://testserver --token {token}" in page
    assert 'data-device="garage-pc"' in page and '<span class="status offline">offline</span>' in page


def test_contributor_sees_a_quarantined_device_with_its_reason(contributor):
    device = register_device(contributor, "flaky")
    Device.objects.filter(pk=device.pk).update(quarantined_at="2026-01-01T00:00:00Z",
                                               quarantine_reason="3 failed results: loss got worse")
    page = logged_in(contributor).get("/contribute/").content.decode()
    assert "quarantined" in page and "3 failed results: loss got worse" in page


def test_payout_request_above_the_available_earnings_shows_the_reason(contributor, fake_stripe):
    from billing.models import PayoutAccount

    PayoutAccount.objects.create(contributor=contributor, stripe_account_id="acct_x", payouts_enabled=True)
    response = logged_in(contributor).post("/contribute/payouts/request", {"amount": "25.00"}, follow=True)
    assert "You asked for €25.00 but €0.00 of your earnings is available" in response.content.decode()


def test_staff_lift_a_quarantine_with_a_reason(staff, contributor):
    device = register_device(contributor, "flaky")
    Device.objects.filter(pk=device.pk).update(quarantined_at="2026-01-01T00:00:00Z", quarantine_reason="bad")
    client = logged_in(staff)
    assert "flaky #" in client.get("/staff/").content.decode()

    no_reason = client.post(f"/staff/devices/{device.pk}/lift", {"reason": ""}, follow=True)
    assert "Say why the quarantine is lifted" in no_reason.content.decode()
    client.post(f"/staff/devices/{device.pk}/lift", {"reason": "owner fixed the GPU"})
    device.refresh_from_db()
    assert device.quarantined_at is None and device.events.get(kind="lifted").actor == staff


def test_customer_cancels_a_running_job_and_the_unused_hold_comes_back(customer, customer_client, digits):
    from billing import selectors as ledger

    before = ledger.balances_for(user=customer)["customer_available"]
    customer_client.post("/jobs/new/", {"dataset": digits.pk, "template": "mlp", "rounds": 2,
                                        "aggregation": "fedavg", "action": "quote"})
    customer_client.post("/jobs/new/", {"dataset": digits.pk, "template": "mlp", "rounds": 2,
                                        "aggregation": "fedavg", "action": "accept", "quote": Quote.objects.get().pk})
    job = Job.objects.get()
    assert "Cancel the job" in customer_client.get(f"/jobs/{job.pk}/").content.decode()

    page = customer_client.post(f"/jobs/{job.pk}/cancel", follow=True).content.decode()
    job.refresh_from_db()
    assert job.status == Job.Status.CANCELLED and f"Job {job.pk} is cancelled" in page
    assert ledger.balances_for(user=customer)["customer_available"] == before
    again = customer_client.post(f"/jobs/{job.pk}/cancel", follow=True).content.decode()
    assert "has already ended (cancelled)" in again


def test_unit_counts_per_round_come_from_one_query_however_many_units(customer, customer_client, digits):
    """The job page's poll and GET /api/jobs/<id> count each round's units by status in the database: they loaded
    every unit of every round, O(the job's units) on every poll."""
    job = job_services.job_create(owner=customer, dataset=digits, template="mlp", hparams={}, rounds=3, seed=1)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    api = APIClient()
    api.force_authenticate(customer)

    def polled() -> tuple[list, list, int]:
        with CaptureQueriesContext(connection) as queries:
            page = customer_client.get(f"/jobs/{job.pk}/progress").json()["round_list"]
            detail = api.get(f"/api/jobs/{job.pk}").json()["round_list"]
        unit_reads = [q["sql"] for q in queries if WorkUnit._meta.db_table in q["sql"]
                      and '"flagged" = ' not in q["sql"]]  # (updates in doubt, fetched: a few at most)
        assert unit_reads and all("COUNT(" in sql for sql in unit_reads), unit_reads  # counted, never fetched
        return [r["units"] for r in page], [r["units"] for r in detail], len(queries)

    rnd = job_services.round_open(job_id=job.pk, devices=[(9000 + i, 1.0) for i in range(3)])
    _, _, few = polled()
    units = list(rnd.units.order_by("index"))
    WorkUnit.objects.filter(pk=units[0].pk).update(status=WorkUnit.Status.LEASED)
    WorkUnit.objects.filter(pk=units[1].pk).update(status=WorkUnit.Status.ACCEPTED)
    rnd.status = rnd.Status.CLOSED
    rnd.save(update_fields=["status"])
    Job.objects.filter(pk=job.pk).update(current_round=1)
    second = job_services.round_open(job_id=job.pk, devices=[(9000 + i, 1.0) for i in range(40)]).units.count()

    page, detail, many = polled()

    assert second > 3 and page == detail == [{"leased": 1, "accepted": 1, "queued": 1}, {"queued": second}]
    assert many == few  # more units in two rounds cost the queries 3 units in one did


def test_job_progress_reports_rounds_money_and_the_waiting_note(customer, customer_client, digits, contributor):
    device = register_device(contributor, "online")  # a device that can run the job is online
    customer_client.post("/jobs/new/", {"dataset": digits.pk, "template": "mlp", "rounds": 2,
                                        "aggregation": "fedavg", "action": "quote"})
    customer_client.post("/jobs/new/", {"dataset": digits.pk, "template": "mlp", "rounds": 2,
                                        "aggregation": "fedavg", "action": "accept", "quote": Quote.objects.get().pk})
    job = Job.objects.get()

    opening = customer_client.get(f"/jobs/{job.pk}/progress").json()
    job_services.round_open(job_id=job.pk, devices=[])  # what the open_round task does once the start commits
    waiting = customer_client.get(f"/jobs/{job.pk}/progress").json()

    assert opening["status"] == "running" and opening["round_list"] == []
    assert opening["note"] == "Opening the next round…"
    assert waiting["rounds"] == 2 and waiting["rounds_done"] == 0 and waiting["round_list"][0]["units"] == {"queued": 1}
    assert waiting["note"] == "Round 1: waiting for a device to claim the work."
    assert waiting["money"]["quoted_nanos"] == Quote.objects.get().price and waiting["devices"] == []

    Device.objects.filter(pk=device.pk).update(last_seen_at=None)  # it goes away: nothing online can run the job
    stuck = customer_client.get(f"/jobs/{job.pk}/progress").json()
    assert stuck["note"].startswith("No online device can run this job yet") and "no device is online" in stuck["note"]
    assert "no device is online" in customer_client.get(f"/jobs/{job.pk}/").content.decode()
