"""Staff credit a customer's balance from the site (a ledger grant with its audit row), and `make run`'s demo
credit on sign-up (MUNINN_DEMO_CREDIT)."""
from __future__ import annotations

from decimal import Decimal

import pytest
from django.test import Client
from rest_framework.test import APIClient

from accounts import services as accounts
from accounts.models import User
from billing import money
from billing import selectors as ledger
from billing.models import Account, CreditAudit, Entry, Transaction

pytestmark = pytest.mark.django_db


def logged_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def available(user: User) -> int:
    return ledger.balances_for(user=user).get(Account.Kind.CUSTOMER_AVAILABLE, 0)


def sign_up_form(username: str) -> dict:
    return {"username": username, "email": f"{username}@example.com", "password1": "a-long-pass-123",
            "password2": "a-long-pass-123", "role": "customer"}


def books() -> tuple[int, int, int]:
    return Transaction.objects.count(), Entry.objects.count(), CreditAudit.objects.count()


def test_staff_credit_a_customer_from_the_site_as_an_audited_ledger_grant(staff, customer):
    before = available(customer)

    response = logged_in(staff).post("/staff/credits/", {"customer": "alice", "amount": "25.50",
                                                          "reason": "Stripe is off: trial credit"})

    assert response.status_code == 302 and response["Location"] == "/staff/credits/"
    assert available(customer) == before + money.to_nanos("25.50")
    audit = CreditAudit.objects.get(reason="Stripe is off: trial credit")
    assert (audit.customer, audit.actor, audit.amount) == (customer, staff, money.to_nanos("25.50"))
    assert audit.at is not None
    txn = audit.transaction
    assert (txn.kind, txn.created_by, txn.memo) == (Transaction.Kind.GRANT, staff, "Stripe is off: trial credit")
    lines = {e.account.kind: e.amount for e in txn.entries.select_related("account")}
    assert lines == {Account.Kind.PLATFORM_GRANTS: -money.to_nanos("25.50"),
                     Account.Kind.CUSTOMER_AVAILABLE: money.to_nanos("25.50")}
    page = logged_in(staff).get("/staff/credits/").content.decode()
    assert "Stripe is off: trial credit" in page and "€25.50" in page
    statement = logged_in(customer).get("/balance/").content.decode()
    assert "Stripe is off: trial credit" in statement


@pytest.mark.parametrize("role", [User.Role.CUSTOMER, User.Role.CONTRIBUTOR])
def test_only_staff_may_credit_a_balance(role, customer):
    other = accounts.user_create(username=f"not-staff-{role}", password="pass-12345678", role=role)
    count = books()

    for method in ("get", "post"):
        response = getattr(logged_in(other), method)("/staff/credits/", {"customer": "alice", "amount": "5.00",
                                                                         "reason": "myself"})
        assert response.status_code == 403

    assert books() == count


@pytest.mark.parametrize("fields, field, message", [
    ({"amount": "0"}, "amount", "positive amount"),
    ({"amount": "-5"}, "amount", "positive amount"),
    ({"amount": "abc"}, "amount", "such as 20.00"),
    ({"amount": "1.234"}, "amount", "whole cents"),
    ({"amount": ""}, "amount", "Enter an amount"),
    ({"amount": "10000.01"}, "amount", "At most 10000.00"),
    ({"reason": "   "}, "reason", "Say why"),
    ({"customer": "nobody"}, "customer", "No customer is called"),
    ({"customer": "bob"}, "customer", "No customer is called"),  # a contributor has no balance to credit
])
def test_a_bad_credit_is_refused_with_a_clear_error_and_changes_nothing(staff, customer, contributor, fields,
                                                                        field, message):
    count, before = books(), available(customer)
    data = {"customer": "alice", "amount": "5.00", "reason": "goodwill"} | fields

    response = logged_in(staff).post("/staff/credits/", data)

    assert response.status_code == 400
    errors = response.context["form"].errors
    assert message in " ".join(errors[field]), errors
    assert books() == count and available(customer) == before


def test_staff_page_links_to_the_credit_form(staff):
    assert 'href="/staff/credits/"' in logged_in(staff).get("/staff/").content.decode()


def test_a_new_customer_gets_the_demo_credit_when_it_is_set(settings, db):
    settings.MUNINN_DEMO_CREDIT = Decimal("100.00")

    page = Client().post("/signup/", sign_up_form("newbie"))
    api = APIClient().post("/api/auth/signup", {"username": "newbie2", "password": "a-long-pass-123",
                                                "role": "customer"}, format="json")

    assert page.status_code == 302 and api.status_code == 201
    for name in ("newbie", "newbie2"):
        user = User.objects.get(username=name)
        assert available(user) == money.to_nanos("100.00")
        audit = CreditAudit.objects.get(customer=user)
        assert audit.actor is None and audit.transaction.kind == Transaction.Kind.GRANT
    contributor = APIClient().post("/api/auth/signup", {"username": "helper", "password": "a-long-pass-123",
                                                        "role": "contributor"}, format="json")
    assert contributor.status_code == 201
    assert not CreditAudit.objects.filter(customer__username="helper").exists()


def test_no_demo_credit_when_it_is_unset(settings, db):
    settings.MUNINN_DEMO_CREDIT = Decimal("0")

    response = Client().post("/signup/", sign_up_form("newbie"))

    assert response.status_code == 302
    assert available(User.objects.get(username="newbie")) == 0
    assert not Transaction.objects.filter(kind=Transaction.Kind.GRANT).exists()

