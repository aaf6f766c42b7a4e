"""The worker API tells a device what its accepted unit earned, in money (the contributor's share of the unit's
charge), so the worker client can print it in euros rather than HU."""
from __future__ import annotations

from decimal import Decimal

import pytest

from billing import money
from billing import services as billing
from billing.models import Account, Entry

from .conftest import digits_npz, named_file

pytestmark = pytest.mark.django_db(transaction=True)  # rounds open on commit


def test_an_accepted_unit_answer_says_what_its_contributor_earned(settings, customer_api, make_device, contributor,
                                                                  staff, customer):
    settings.MUNINN_PRICE_PER_HU = Decimal(10**9)  # a visible amount whatever the minimum-charge rules
    billing.balance_grant(user=customer, amount=money.to_nanos("1000"), reason="test", granted_by=staff)
    device = make_device("new", answer=False)  # a new device: its result is checked first
    dataset = customer_api.post("/api/datasets", {"file": named_file(digits_npz(200), "digits.npz")},
                                format="multipart").json()["id"]
    job = customer_api.post("/api/jobs", {"dataset": dataset, "template": "mlp", "rounds": 1, "start": True},
                            format="json")
    assert job.status_code == 201, job.content
    unit = device.claim()

    uploaded = device.submit(unit["id"], *device.train(unit)).json()
    answers = [r.json() for r in device.answer_challenge(uploaded["challenge"])]

    assert uploaded["status"] == "pending"
    assert (uploaded["earned_nanos"], Decimal(uploaded["credited_hu"]), uploaded["currency"]) == (0, 0, "EUR")
    decided = answers[-1]
    assert decided["status"] == "accepted"
    earned = Entry.objects.get(account__kind=Account.Kind.CONTRIBUTOR_PENDING, account__owner=contributor,
                               transaction__unit_id=unit["id"]).amount
    assert earned > 0
    assert decided["earned_nanos"] == earned
    assert decided["earned"] == money.format_money(earned, "EUR") and decided["earned"].startswith("€")
    assert Decimal(decided["credited_hu"]) > 0
    again = device.submit(unit["id"], *device.train(unit)).json()  # a retry after a lost answer: the same credit
    assert (again["status"], again["earned_nanos"], again["earned"]) == ("accepted", earned, decided["earned"])
