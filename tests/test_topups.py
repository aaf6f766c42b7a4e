"""Top-ups through Stripe Checkout, credited by the verified checkout.session.completed webhook, exactly once."""
from __future__ import annotations

import time

import pytest
from rest_framework.test import APIClient

from billing import money
from billing import selectors as ledger
from billing.models import Entry, StripeEvent, TopUp, Transaction

from .conftest import post_webhook
from .fake_stripe import event

pytestmark = pytest.mark.django_db


def available(user) -> int:
    return ledger.balances_for(user=user).get("customer_available", 0)


def paid_session(topup: dict, fake) -> dict:
    created = fake.calls("/v1/checkout/sessions")[-1]
    amount = int(created.params["line_items"]["0"]["price_data"]["unit_amount"])
    session_id = topup["checkout_url"].rsplit("/", 1)[1]
    return {"id": session_id, "object": "checkout.session", "payment_status": "paid", "status": "complete",
            "amount_total": amount, "currency": "eur", "client_reference_id": str(topup["id"])}


def start_topup(customer_api, amount: str = "20.00") -> dict:
    response = customer_api.post("/api/topups", {"amount": amount}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def test_checkout_session_is_created_for_the_amount_in_cents(customer_api, fake_stripe):
    topup = start_topup(customer_api, "20.00")

    created = fake_stripe.calls("/v1/checkout/sessions")
    assert len(created) == 1
    assert created[0].params["line_items"]["0"]["price_data"]["unit_amount"] == "2000"
    assert created[0].params["mode"] == "payment"
    assert created[0].headers["idempotency-key"] == f"topup-{topup['id']}"
    assert created[0].headers["stripe-version"] == "2026-10-28.endive"
    assert topup["checkout_url"].startswith("https://checkout.stripe.com/")
    assert TopUp.objects.get().status == TopUp.Status.OPEN


def test_completed_checkout_credits_the_balance_once_however_often_it_arrives(customer_api, customer, fake_stripe):
    before = available(customer)
    topup = start_topup(customer_api, "20.00")
    completed = event("checkout.session.completed", paid_session(topup, fake_stripe))
    webhook = APIClient()

    first = post_webhook(webhook, completed)
    replay = post_webhook(webhook, completed)

    assert first.status_code == 200 and first.json()["status"] == "processed"
    assert replay.status_code == 200
    assert available(customer) == before + money.to_nanos("20.00")
    assert Transaction.objects.filter(kind=Transaction.Kind.TOPUP).count() == 1
    assert StripeEvent.objects.get().status == StripeEvent.Status.PROCESSED
    assert TopUp.objects.get().status == TopUp.Status.PAID
    assert ledger.ledger_total() == 0


def test_unpaid_completion_credits_nothing(customer_api, customer, fake_stripe):
    before = available(customer)
    topup = start_topup(customer_api)
    session = {**paid_session(topup, fake_stripe), "payment_status": "unpaid"}

    response = post_webhook(APIClient(), event("checkout.session.completed", session))

    assert response.status_code == 200
    assert available(customer) == before


def assert_nothing_changed(entries_before: int) -> None:
    assert Entry.objects.count() == entries_before
    assert not StripeEvent.objects.exists()


@pytest.mark.parametrize("sign, why", [
    ({"secret": "whsec_someone_else"}, "bad signature"),
    ({"timestamp": int(time.time()) - 3600}, "stale timestamp"),
])
def test_webhook_that_does_not_verify_is_refused_and_changes_nothing(customer_api, fake_stripe, sign, why):
    topup = start_topup(customer_api)
    entries = Entry.objects.count()

    response = post_webhook(APIClient(), event("checkout.session.completed", paid_session(topup, fake_stripe)), **sign)

    assert response.status_code == 400, why
    assert response.json()["error"]["code"] == "bad_signature"
    assert_nothing_changed(entries)


def test_webhook_without_a_signature_header_is_refused(fake_stripe):
    response = APIClient().post("/api/stripe/webhook", data=b"{}", content_type="application/json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "bad_signature"


def test_unknown_event_type_is_refused_and_changes_nothing(customer_api, fake_stripe):
    entries = Entry.objects.count()

    response = post_webhook(APIClient(), event("invoice.paid", {"id": "in_1", "object": "invoice"}))

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "unknown_event_type" and "invoice.paid" in error["message"]
    assert_nothing_changed(entries)


def test_completion_for_a_session_we_never_made_is_stored_as_failed_and_credits_nothing(customer, fake_stripe):
    before = available(customer)
    session = {"id": "cs_test_forged", "object": "checkout.session", "payment_status": "paid",
               "amount_total": 100000, "currency": "eur"}

    response = post_webhook(APIClient(), event("checkout.session.completed", session))

    assert response.status_code == 200
    assert StripeEvent.objects.get().status == StripeEvent.Status.FAILED
    assert available(customer) == before


@pytest.mark.parametrize("amount, code", [("0.50", "below_minimum"), ("999999.00", "above_maximum")])
def test_top_up_outside_the_limits_is_refused(customer_api, fake_stripe, amount, code):
    response = customer_api.post("/api/topups", {"amount": amount}, format="json")

    assert response.status_code == 400
    assert response.json()["error"]["code"] == code
    assert not TopUp.objects.exists() and not fake_stripe.requests


def test_without_stripe_keys_top_ups_are_disabled_with_a_clear_message(customer_api, settings):
    settings.STRIPE_SECRET_KEY = ""

    info = customer_api.get("/api/topups").json()
    response = customer_api.post("/api/topups", {"amount": "20.00"}, format="json")

    assert info["enabled"] is False
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "payments_disabled" and "STRIPE_SECRET_KEY" in error["message"]
    assert not TopUp.objects.exists()


def test_stripe_refusing_the_session_is_a_clear_error(customer_api, fake_stripe, settings):
    settings.STRIPE_SECRET_KEY = "sk_test_wrong"

    response = customer_api.post("/api/topups", {"amount": "20.00"}, format="json")

    assert response.status_code == 502
    assert response.json()["error"]["code"] == "payment_provider_error"


def test_staff_credit_by_hand_records_who_and_why(customer, staff):
    from django.core.management import call_command
    from django.core.management.base import CommandError

    before = available(customer)

    call_command("grant_credit", customer.username, "15.00", reason="refund for a failed job", by=staff.username)
    with pytest.raises(CommandError):
        call_command("grant_credit", customer.username, "15.00", reason=" ", by=staff.username)

    assert available(customer) == before + money.to_nanos("15")
    grant = Transaction.objects.filter(kind=Transaction.Kind.GRANT).last()
    assert grant.created_by == staff and grant.memo == "refund for a failed job"
