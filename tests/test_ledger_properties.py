"""Property-based: random sequences of top-ups, quotes, job starts, verified and rejected units, cancellations,
earnings held for review and released or forfeited, clearing, payout requests, approvals, rejections and failed
transfers. After every step the books balance, no person's balance is negative, no job is charged more than its
quote, every HU credited to a contributor traces to an accepted receipt, and held earnings never clear."""
from __future__ import annotations

import itertools
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db.models import Sum
from django.utils import timezone
from hypothesis import HealthCheck, settings as hsettings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from accounts import services as accounts
from accounts.models import User
from billing import money, payments, payouts, services
from billing import selectors as ledger
from billing.models import Account, Entry, Payout, PayoutAccount, Quote, Transaction
from contributors.models import Device, Receipt
from jobs import services as jobs
from jobs.models import Job, WorkUnit
from muninn.errors import MuninnError

from . import invariants
from .conftest import SimulatedDevice, digits_npz
from .fake_stripe import event, signed

pytestmark = pytest.mark.django_db(transaction=True)
_names = itertools.count()
PICK = st.integers(min_value=0, max_value=2**16)  # which of the existing quotes, events or payouts a step uses


def _running(self) -> bool:
    return Job.objects.filter(owner=self.customer, status=Job.Status.RUNNING).exists()


def _balance(self, kind: str) -> int:
    return ledger.balances_for(user=self.contributor).get(kind, 0)


def _waiting_payouts(self) -> bool:
    return self.contributor.payouts.filter(status="requested").exists()


class MoneyMachine(RuleBasedStateMachine):
    """Preconditions keep the random steps meaningful (a payout is requested only when there are earnings, ...),
    so that short sequences still reach the far ends of the money's paths."""

    fake_stripe = None  # set by the test
    settings = None  # pytest-django's, which puts back what a sequence changes

    @initialize()
    def market(self):
        n = next(_names)
        # Each sequence is its own market: the rows of earlier ones stay (the invariants cover them too), but their
        # jobs stop and their devices go offline, so that work is not sharded to devices that are gone.
        for job_id in Job.objects.filter(status=Job.Status.RUNNING).values_list("id", flat=True):
            jobs.job_cancel(job_id=job_id)
        Device.objects.update(is_active=False)
        self.staff = accounts.user_create(username=f"pstaff{n}", password="staff-pass-123", role=User.Role.STAFF)
        self.customer = accounts.user_create(username=f"pcust{n}", password="cust-pass-123")
        self.contributor = accounts.user_create(username=f"pcontrib{n}", password="contrib-pass-123",
                                                role=User.Role.CONTRIBUTOR)
        self.account = PayoutAccount.objects.create(contributor=self.contributor, stripe_account_id=f"acct_prop{n}",
                                                    payouts_enabled=True)
        self.device = SimulatedDevice(self.contributor, f"pdev{n}")
        self.dataset = jobs.dataset_create(owner=self.customer, filename="digits.npz", data=digits_npz(120))
        self.now = timezone.now()
        self.quotes: list[Quote] = []
        self.events: list[dict] = []
        # A head start: each sequence begins with a running job that has verified work, so that short random
        # sequences still reach clearing, payouts and their reviews.
        self.top_up(euros=100)
        self.quote(rounds=2, epochs=1)
        self.start_job(pick=0)
        self.verified_units(units=2)

    # --- customers ----------------------------------------------------------------------------------
    @rule(euros=st.integers(min_value=5, max_value=400))
    def top_up(self, euros):
        topup = payments.topup_start(customer=self.customer, amount=Decimal(euros))
        self.events.append(event("checkout.session.completed", {
            "id": topup.stripe_session_id, "object": "checkout.session", "payment_status": "paid",
            "amount_total": euros * 100, "currency": "eur"}))
        payments.webhook_receive(**dict(zip(("payload", "signature"), signed(self.events[-1]))))

    @precondition(lambda self: self.events)
    @rule(pick=PICK)
    def replay_webhook(self, pick):
        payments.webhook_receive(**dict(zip(("payload", "signature"), signed(self.events[pick % len(self.events)]))))

    @rule(rounds=st.integers(min_value=1, max_value=3), epochs=st.integers(min_value=1, max_value=2))
    def quote(self, rounds, epochs):
        self.quotes.append(services.quote_issue(customer=self.customer, dataset=self.dataset, template="mlp",
                                                hparams={"epochs": epochs, "hidden": [16]}, rounds=rounds,
                                                now=self.now))

    @precondition(lambda self: any(q.job_id is None for q in self.quotes))
    @rule(pick=PICK)
    def start_job(self, pick):
        quote = self.quotes[pick % len(self.quotes)]
        try:
            services.quote_accept(customer=self.customer, quote_id=quote.pk, now=self.now)
        except MuninnError as e:
            assert e.code in ("insufficient_balance", "quote_expired", "quote_used"), e.code
        quote.refresh_from_db()

    @rule(hours=st.sampled_from([1, 6, 25, 72]))  # quotes expire within the hour; earnings clear after a day
    def time_passes(self, hours):
        self.now += timedelta(hours=hours)

    @rule(minimum=st.sampled_from(["0", "0.50", "60"]))  # a job here costs tens of euros: €60 is above most
    def minimum_charge_changes(self, minimum):  # quotes made from now on state the new minimum charge per job
        self.settings.MUNINN_MIN_CHARGE_PER_JOB = Decimal(minimum)

    @rule(pick=PICK)
    def settle_an_ended_job_again(self, pick):  # a job_ended signal delivered twice moves nothing
        ended = list(Job.objects.filter(owner=self.customer, status__in=Job.ENDED).order_by("id"))
        if ended:
            job = ended[pick % len(ended)]
            before = Transaction.objects.count()
            services.minimum_charge_settle(job=job)
            services.hold_release(job=job)
            assert Transaction.objects.count() == before

    @precondition(_running)
    @rule(coin=st.integers(min_value=0, max_value=3))
    def cancel_a_job(self, coin):
        job = Job.objects.filter(owner=self.customer, status=Job.Status.RUNNING).first()
        if job is not None and coin == 0:  # now and then: a cancelled job stops all its work
            jobs.job_cancel(job_id=job.pk)

    # --- devices --------------------------------------------------------------------------------------
    @precondition(_running)
    @rule(units=st.integers(min_value=1, max_value=4))
    def verified_units(self, units):
        for _ in range(units):
            unit = self.device.claim()
            if unit is None:
                return
            response = self.device.submit(unit["id"], *self.device.train(unit))
            assert response.status_code == 201, response.content

    @precondition(_running)
    @rule()
    def rejected_unit(self):
        unit = self.device.claim()
        if unit is None:
            return
        weights, receipt = self.device.train(unit)
        response = self.device.submit(unit["id"], weights, {**receipt, "output_sha256": "0" * 64})
        assert response.status_code == 400, response.content
        WorkUnit.objects.filter(pk=unit["id"]).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
        jobs.units_requeue_expired()
        # time passes beyond the refused unit's backoff (and the refused device's longer one)
        WorkUnit.objects.filter(pk=unit["id"]).update(not_before=None, refused_device_id=None)

    # --- earnings and payouts ----------------------------------------------------------------------------
    @precondition(lambda self: _balance(self, Account.Kind.CONTRIBUTOR_PENDING) > 0)
    @rule(pick=PICK)
    def forfeit(self, pick):
        settled = [Transaction.Kind.CLEAR, Transaction.Kind.FORFEIT]
        open_charges = list(Transaction.objects.filter(kind=Transaction.Kind.CHARGE, job__owner=self.customer)
                            .exclude(followups__kind__in=settled).order_by("id"))
        if open_charges:
            services.earnings_forfeit(unit=open_charges[pick % len(open_charges)].unit, staff=self.staff,
                                      reason="found fraudulent")

    @precondition(lambda self: _balance(self, Account.Kind.CONTRIBUTOR_PENDING) > 0)
    @rule()
    def hold_for_review(self):  # the device is quarantined: its uncleared earnings are held while staff review it
        services.earnings_hold_units(units=WorkUnit.objects.filter(round__job__owner=self.customer),
                                     reason="device quarantined")

    @precondition(lambda self: _balance(self, Account.Kind.CONTRIBUTOR_HELD) > 0)
    @rule(pick=PICK, fraud=st.booleans())
    def review(self, pick, fraud):  # staff decide on one held unit: fraud (forfeit) or not (release)
        held = list(Transaction.objects.filter(kind=Transaction.Kind.EARNINGS_HOLD, job__owner=self.customer)
                    .order_by("unit_id").values_list("unit_id", flat=True).distinct())
        if not held:
            return
        units = WorkUnit.objects.filter(pk=held[pick % len(held)])
        if fraud:
            services.earnings_forfeit_held(units=units, staff=self.staff, reason="found fraudulent")
        else:
            services.earnings_release_held(units=units, staff=self.staff, reason="reviewed")

    @precondition(lambda self: _balance(self, Account.Kind.CONTRIBUTOR_PENDING) > 0)
    @rule(wait=st.booleans())
    def clear_earnings(self, wait):
        if wait:  # the beat task runs once the holding period has passed
            self.now += timedelta(seconds=24 * 3600 + 1)
        services.earnings_clear(now=self.now)

    @precondition(lambda self: _balance(self, Account.Kind.CONTRIBUTOR_AVAILABLE) > 0)
    @rule(percent=st.integers(min_value=10, max_value=120))
    def request_payout(self, percent):
        available = ledger.balances_for(user=self.contributor).get(Account.Kind.CONTRIBUTOR_AVAILABLE, 0)
        cents = available * percent // 100 // money.nanos_per_minor("EUR")
        try:
            payouts.payout_request(contributor=self.contributor, amount=money.from_minor(cents, "EUR"))
        except MuninnError as e:
            assert e.code in ("below_minimum", "above_available"), e.code

    @precondition(_waiting_payouts)
    @rule(coin=st.integers(min_value=0, max_value=2), pick=PICK)
    def approve(self, coin, pick):
        fail = coin == 0  # a third of the transfers fail
        waiting = list(self.contributor.payouts.filter(status="requested").order_by("id"))
        payout = waiting[pick % len(waiting)]
        (self.fake_stripe.failing_destinations.add if fail else self.fake_stripe.failing_destinations.discard)(
            self.account.stripe_account_id)
        done = payouts.payout_approve(payout_id=payout.pk, staff=self.staff)
        assert done.status == ("failed" if fail else "paid")

    @precondition(_waiting_payouts)
    @rule(pick=PICK)
    def reject(self, pick):
        waiting = list(self.contributor.payouts.filter(status="requested").order_by("id"))
        payouts.payout_reject(payout_id=waiting[pick % len(waiting)].pk, staff=self.staff,
                              reason="failed re-execution")

    # --- what must always hold ------------------------------------------------------------------------------
    @invariant()
    def books_balance(self):
        invariants.assert_books_balance()

    @invariant()
    def no_person_is_negative(self):
        invariants.assert_no_negative_balance()

    @invariant()
    def no_job_costs_more_than_its_quote(self):
        for job in Job.objects.filter(owner=self.customer):
            invariants.assert_job_within_quote(job)

    @invariant()
    def every_credited_hu_traces_to_an_accepted_receipt(self):
        invariants.assert_units_credited_once(Job.objects.filter(owner=self.customer))
        charges = Transaction.objects.filter(kind=Transaction.Kind.CHARGE, job__owner=self.customer)
        for charge in charges:
            receipt = Receipt.objects.get(unit=charge.unit, status=Receipt.Status.ACCEPTED)
            assert receipt.device.owner_id == self.contributor.pk

    @invariant()
    def contributor_money_adds_up(self):
        b = ledger.balances_for(user=self.contributor)
        earned = sum(b.get(k, 0) for k in (Account.Kind.CONTRIBUTOR_PENDING, Account.Kind.CONTRIBUTOR_HELD,
                                           Account.Kind.CONTRIBUTOR_AVAILABLE, Account.Kind.CONTRIBUTOR_IN_REVIEW,
                                           Account.Kind.CONTRIBUTOR_PAID_OUT))
        entries = Entry.objects.filter(account__owner=self.contributor)
        credited = entries.filter(account__kind=Account.Kind.CONTRIBUTOR_PENDING,
                                  transaction__kind=Transaction.Kind.CHARGE).aggregate(s=Sum("amount"))["s"] or 0
        forfeited = -(entries.filter(transaction__kind=Transaction.Kind.FORFEIT).aggregate(s=Sum("amount"))["s"] or 0)
        assert earned == credited - forfeited

    @invariant()
    def the_minimum_charge_goes_to_the_platform_once_and_only_for_jobs_that_succeeded(self):
        minimums = Transaction.objects.filter(kind=Transaction.Kind.MINIMUM_CHARGE, job__owner=self.customer)
        assert not minimums.exclude(job__status=Job.Status.SUCCEEDED).exists()
        assert minimums.count() == minimums.values("job").distinct().count()
        assert {e.account.kind for e in Entry.objects.filter(transaction__in=minimums).select_related("account")} \
            <= {Account.Kind.CUSTOMER_HELD, Account.Kind.PLATFORM_FEE}  # never a contributor's

    @invariant()
    def held_earnings_never_clear(self):
        for charge in Transaction.objects.filter(kind=Transaction.Kind.CHARGE, job__owner=self.customer):
            kinds = list(charge.followups.values_list("kind", flat=True))
            held = kinds.count(Transaction.Kind.EARNINGS_HOLD) > kinds.count(Transaction.Kind.EARNINGS_RELEASE)
            assert not (held and Transaction.Kind.CLEAR in kinds), kinds


@pytest.fixture
def market_settings(settings, fake_stripe):
    settings.MUNINN_PRICE_PER_HU = Decimal(10**11)  # a 120-row job costs tens of euros, so payouts happen
    settings.MUNINN_PAYOUT_MIN = Decimal("1.00")
    settings.MUNINN_EARNINGS_HOLD_SECONDS = 24 * 3600
    settings.MUNINN_MIN_CHARGE_PER_JOB = Decimal("0.50")
    MoneyMachine.fake_stripe = fake_stripe
    MoneyMachine.settings = settings


def test_money_invariants_hold_over_random_sequences(market_settings):
    run_state_machine_as_test(MoneyMachine, settings=hsettings(
        max_examples=6, stateful_step_count=30, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    assert Transaction.objects.filter(kind=Transaction.Kind.CHARGE).exists()


def test_money_invariants_hold_along_every_path(market_settings):
    """The same machine walked through every kind of step in one fixed order, checking the invariants after each:
    the random sequences above are not guaranteed to reach every path, this walk is."""
    machine = MoneyMachine()
    steps = [
        ("market", {}), ("top_up", {"euros": 200}), ("replay_webhook", {"pick": 0}),
        ("quote", {"rounds": 1, "epochs": 2}), ("time_passes", {"hours": 1}), ("start_job", {"pick": 1}),  # expired
        ("quote", {"rounds": 3, "epochs": 1}), ("start_job", {"pick": 2}), ("start_job", {"pick": 2}),  # used
        ("rejected_unit", {}), ("verified_units", {"units": 1}), ("forfeit", {"pick": 0}),
        ("cancel_a_job", {"coin": 0}),
        # a job whose work costs less than the minimum succeeds: it pays the minimum, once
        ("minimum_charge_changes", {"minimum": "60"}), ("quote", {"rounds": 1, "epochs": 1}),
        ("start_job", {"pick": 3}), ("verified_units", {"units": 2}), ("settle_an_ended_job_again", {"pick": 1}),
        ("hold_for_review", {}), ("hold_for_review", {}), ("clear_earnings", {"wait": True}),  # held: nothing clears
        ("review", {"pick": 0, "fraud": True}), ("review", {"pick": 1, "fraud": False}),
        ("review", {"pick": 0, "fraud": False}),
        ("clear_earnings", {"wait": False}), ("clear_earnings", {"wait": True}),
        ("request_payout", {"percent": 200}), ("request_payout", {"percent": 30}), ("approve", {"coin": 1, "pick": 0}),
        ("request_payout", {"percent": 30}), ("approve", {"coin": 0, "pick": 0}),
        ("request_payout", {"percent": 50}), ("reject", {"pick": 0}),
    ]
    for name, kwargs in steps:
        getattr(machine, name)(**kwargs)
        for invariant_name in ("books_balance", "no_person_is_negative", "no_job_costs_more_than_its_quote",
                               "every_credited_hu_traces_to_an_accepted_receipt", "contributor_money_adds_up",
                               "held_earnings_never_clear",
                               "the_minimum_charge_goes_to_the_platform_once_and_only_for_jobs_that_succeeded"):
            getattr(machine, invariant_name)()

    kinds = set(Transaction.objects.values_list("kind", flat=True))
    assert kinds == set(Transaction.Kind.values) - {Transaction.Kind.GRANT}, kinds
    assert sorted(Payout.objects.values_list("status", flat=True)) == ["failed", "paid", "rejected"]
    assert Receipt.objects.filter(status=Receipt.Status.REJECTED).exists()
