"""Money under concurrency on PostgreSQL (threads, each with its own connection): duplicate webhooks credit once,
two staff approving one payout pay once, two jobs racing for one balance hold it once."""
from __future__ import annotations

import threading
from decimal import Decimal

import pytest
from django.db import connection
from django.test import Client

from billing import money, payouts
from billing import selectors as ledger
from billing.models import Payout, StripeEvent, Transaction
from jobs import services as jobs
from jobs.models import Job
from muninn.errors import MuninnError

from .conftest import digits_npz
from .fake_stripe import event, signed

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]
THREADS = 8


@pytest.fixture(autouse=True)
def _needs_postgres():
    if connection.vendor != "postgresql":
        pytest.fail("this test needs PostgreSQL: run it through `make test` (DATABASE_URL=postgres://...)")


def race(fn, n: int = THREADS) -> tuple[list, list[BaseException]]:
    """Run fn(i) in n threads released at once; their results and the errors they raised."""
    barrier = threading.Barrier(n)
    results, errors, lock = [], [], threading.Lock()

    def run(i: int) -> None:
        try:
            barrier.wait()
            out = fn(i)
            with lock:
                results.append(out)
        except BaseException as e:  # noqa: BLE001  (returned to the test)
            with lock:
                errors.append(e)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def test_duplicate_webhooks_arriving_together_credit_once(customer, customer_api, fake_stripe):
    before = ledger.balances_for(user=customer)["customer_available"]
    topup = customer_api.post("/api/topups", {"amount": "25.00"}, format="json").json()
    session = {"id": topup["checkout_url"].rsplit("/", 1)[1], "object": "checkout.session", "payment_status": "paid",
               "amount_total": 2500, "currency": "eur"}
    body, header = signed(event("checkout.session.completed", session))

    results, errors = race(lambda i: Client().post("/api/stripe/webhook", data=body, content_type="application/json",
                                                   HTTP_STRIPE_SIGNATURE=header).status_code)

    assert not errors, errors
    assert results == [200] * THREADS
    assert StripeEvent.objects.count() == 1
    assert Transaction.objects.filter(kind=Transaction.Kind.TOPUP).count() == 1
    assert ledger.balances_for(user=customer)["customer_available"] == before + money.to_nanos("25")


def test_two_staff_approving_at_once_pay_once(ready, staff, fake_stripe):
    payout = payouts.payout_request(contributor=ready, amount=money.to_nanos("10"))

    results, errors = race(lambda i: payouts.payout_approve(payout_id=payout.pk, staff=staff).status)

    assert results == [Payout.Status.PAID]
    assert len(errors) == THREADS - 1 and all(getattr(e, "code", None) == "already_decided" for e in errors), errors
    assert len(fake_stripe.calls("/v1/transfers")) == 1
    assert Transaction.objects.filter(kind=Transaction.Kind.PAYOUT).count() == 1
    assert ledger.balances_for(user=ready)["contributor_paid_out"] == money.to_nanos("10")


def test_two_jobs_racing_for_one_balance_hold_it_once(customer, settings):
    dataset = jobs.dataset_create(owner=customer, filename="digits.npz", data=digits_npz(300))
    created = [jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams={}, rounds=1, seed=i)
               for i in range(2)]
    available = ledger.balances_for(user=customer)["customer_available"]
    # Price the work so that one job costs a bit more than half the balance: only one of the two fits.
    settings.MUNINN_PRICE_PER_HU = Decimal(available) * Decimal("0.6") * money.FLOPS_PER_HU / Decimal(
        created[0].flops_estimated) / money.NANOS_PER_UNIT

    results, errors = race(lambda i: jobs.job_start(job_id=created[i].pk).pk, n=2)

    assert len(results) == 1 and len(errors) == 1, (results, errors)
    assert isinstance(errors[0], MuninnError) and errors[0].code == "insufficient_balance"
    statuses = sorted(Job.objects.filter(pk__in=[j.pk for j in created]).values_list("status", flat=True))
    assert statuses == [Job.Status.CREATED, Job.Status.RUNNING]
    assert Transaction.objects.filter(kind=Transaction.Kind.HOLD).count() == 1
    assert 0 <= ledger.balances_for(user=customer)["customer_available"] < available
