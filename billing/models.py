"""Money: a double-entry ledger (transactions of entries that sum to zero, append-only; balances are derived),
the quotes customers accept, Stripe top-ups and webhook events, and contributor payouts."""
import uuid

from django.conf import settings
from django.db import models


class Account(models.Model):
    class Kind(models.TextChoices):
        CUSTOMER_AVAILABLE = "customer_available", "Customer balance"
        CUSTOMER_HELD = "customer_held", "Customer held for jobs"
        CONTRIBUTOR_PENDING = "contributor_pending", "Contributor pending earnings"
        # Unverified earnings of a quarantined device while staff review it: they do not clear from here.
        CONTRIBUTOR_HELD = "contributor_held", "Contributor earnings held for review"
        CONTRIBUTOR_AVAILABLE = "contributor_available", "Contributor available earnings"
        CONTRIBUTOR_IN_REVIEW = "contributor_in_review", "Contributor payouts in review"
        CONTRIBUTOR_PAID_OUT = "contributor_paid_out", "Contributor paid out"
        PLATFORM_FEE = "platform_fee", "Platform fees"
        PLATFORM_GRANTS = "platform_grants", "Manual credits granted by staff"
        STRIPE_CLEARING = "stripe_clearing", "Stripe clearing"

    # The accounts of people: never below zero. Platform accounts are the other side of the books.
    USER_KINDS = (Kind.CUSTOMER_AVAILABLE, Kind.CUSTOMER_HELD, Kind.CONTRIBUTOR_PENDING, Kind.CONTRIBUTOR_HELD,
                  Kind.CONTRIBUTOR_AVAILABLE, Kind.CONTRIBUTOR_IN_REVIEW, Kind.CONTRIBUTOR_PAID_OUT)

    key = models.CharField(max_length=120, unique=True)  # "user:<id>:<kind>" or "platform:<kind>"
    kind = models.CharField(max_length=32, choices=Kind.choices)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                              related_name="ledger_accounts")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.key


class Transaction(models.Model):
    class Kind(models.TextChoices):
        GRANT = "grant", "Manual credit"
        TOPUP = "topup", "Top-up"
        HOLD = "hold", "Hold for a job"
        CHARGE = "charge", "Charge for verified work"
        RELEASE = "release", "Release of an unused hold"
        CLEAR = "clear", "Earnings cleared"
        EARNINGS_HOLD = "earnings_hold", "Earnings held for review"
        EARNINGS_RELEASE = "earnings_release", "Held earnings released after review"
        FORFEIT = "forfeit", "Earnings forfeited (work found fraudulent), refunded"
        PAYOUT_REQUEST = "payout_request", "Payout requested"
        PAYOUT = "payout", "Payout transferred"
        PAYOUT_RETURN = "payout_return", "Payout returned (rejected, failed or reversed)"
        MINIMUM_CHARGE = "minimum_charge", "Minimum charge per job"

    idempotency_key = models.CharField(max_length=200, unique=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    memo = models.CharField(max_length=500, blank=True)
    job = models.ForeignKey("jobs.Job", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    unit = models.ForeignKey("jobs.WorkUnit", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    flops = models.BigIntegerField(default=0)  # the work a charge pays for (HU = flops / 10^16)
    # The transaction this one follows from: the charge a clearing clears, a review hold holds, a release
    # releases or a forfeit refunds.
    source = models.ForeignKey("self", null=True, blank=True, on_delete=models.PROTECT, related_name="followups")
    payout = models.ForeignKey("billing.Payout", null=True, blank=True, on_delete=models.PROTECT,
                               related_name="transactions")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["kind", "created_at"], name="txn_kind_created")]

    def __str__(self) -> str:
        return f"{self.kind} {self.idempotency_key}"


class Entry(models.Model):
    transaction = models.ForeignKey(Transaction, on_delete=models.PROTECT, related_name="entries")
    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="entries")
    amount = models.BigIntegerField()  # nano-units of settings.MUNINN_CURRENCY; + credit, - debit

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["account", "id"], name="entry_account_id")]

    def __str__(self) -> str:
        return f"{self.account.key} {self.amount:+d}"


class Quote(models.Model):
    """A binding price for one job: what it will cost at most, the devices it needs, and how long it should take.
    Starting a job accepts it; it is a ceiling on the job's charges."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    customer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="quotes")
    dataset = models.ForeignKey("jobs.Dataset", on_delete=models.CASCADE, related_name="+")
    base_weights = models.ForeignKey("jobs.Dataset", null=True, blank=True, on_delete=models.CASCADE,
                                     related_name="+")  # LoRA: the customer's base model
    template = models.CharField(max_length=64)
    hparams = models.JSONField(default=dict)
    rounds = models.PositiveIntegerField()
    aggregation = models.CharField(max_length=16, default="fedavg")
    # The training algorithm the job will be created with (see jobs.Job): part of what was priced.
    algorithm = models.CharField(max_length=16, default="fedavg")
    outer_lr = models.FloatField(null=True, blank=True)
    outer_momentum = models.FloatField(null=True, blank=True)
    inner_steps = models.PositiveIntegerField(null=True, blank=True)
    update_encoding = models.CharField(max_length=8, default="fp32")
    flops = models.BigIntegerField()
    price = models.BigIntegerField()  # nanos: the most the job costs (its hold), max(work_price, minimum_charge)
    # nanos, rounded up: the quoted work at the rate, which its verified units share (and their contributors earn from)
    work_price = models.BigIntegerField()
    # nanos: the least a job that succeeds pays (MUNINN_MIN_CHARGE_PER_JOB when quoted); what its verified work
    # cost below it goes to the platform at the job's end (services.minimum_charge_settle)
    minimum_charge = models.BigIntegerField(default=0)
    price_per_hu = models.DecimalField(max_digits=24, decimal_places=9)
    currency = models.CharField(max_length=3)
    peak_memory_bytes = models.BigIntegerField()
    device_tier = models.CharField(max_length=16)
    devices_online = models.PositiveIntegerField(default=0)  # able to run it, when quoted
    # Able to run it and seen within MUNINN_DEVICE_RECENT_SECONDS, when quoted (None: not asked): with none, the
    # quote warns that the job would wait with its price held.
    devices_recent = models.PositiveIntegerField(null=True, blank=True)
    expected_seconds = models.FloatField(null=True, blank=True)  # None: no capable device online when quoted
    expires_at = models.DateTimeField()
    job = models.OneToOneField("jobs.Job", null=True, blank=True, on_delete=models.PROTECT, related_name="quote")
    accepted_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"quote {self.pk} ({self.template}, {self.rounds} rounds)"


class TopUp(models.Model):
    """A customer's payment through Stripe Checkout. Credited once, by the checkout.session.completed webhook."""

    class Status(models.TextChoices):
        OPEN = "open", "Waiting for payment"
        PAID = "paid", "Paid and credited"

    customer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="topups")
    amount = models.BigIntegerField()  # nanos
    currency = models.CharField(max_length=3)
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.OPEN)
    stripe_session_id = models.CharField(max_length=255, unique=True, null=True, blank=True)
    checkout_url = models.URLField(max_length=2000, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    paid_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"top-up {self.pk} ({self.customer}, {self.status})"


class StripeEvent(models.Model):
    """Every verified webhook event, stored once by Stripe's id, with what handling it did."""

    class Status(models.TextChoices):
        RECEIVED = "received", "Received"
        PROCESSED = "processed", "Processed"
        FAILED = "failed", "Failed"

    stripe_id = models.CharField(max_length=255, unique=True)
    type = models.CharField(max_length=100)
    payload = models.JSONField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.RECEIVED)
    error = models.TextField(blank=True)
    received_at = models.DateTimeField(auto_now_add=True)
    processed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-received_at"]

    def __str__(self) -> str:
        return f"{self.type} {self.stripe_id} ({self.status})"


class PayoutAccount(models.Model):
    """A contributor's Stripe Connect Express account, where approved payouts are transferred."""

    contributor = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.PROTECT,
                                       related_name="payout_account")
    stripe_account_id = models.CharField(max_length=255, unique=True)
    details_submitted = models.BooleanField(default=False)
    payouts_enabled = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.stripe_account_id} ({self.contributor})"


class Payout(models.Model):
    class Status(models.TextChoices):
        REQUESTED = "requested", "Requested, waiting for review"
        APPROVED = "approved", "Approved, transferring"
        PAID = "paid", "Transferred"
        REJECTED = "rejected", "Rejected"
        FAILED = "failed", "Transfer failed, returned to available"
        REVERSED = "reversed", "Transfer reversed, returned to available"

    contributor = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="payouts")
    amount = models.BigIntegerField()  # nanos, whole cents
    currency = models.CharField(max_length=3)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.REQUESTED, db_index=True)
    reviewed_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                                    related_name="+")
    reviewed_at = models.DateTimeField(null=True, blank=True)
    review_reason = models.TextField(blank=True)
    stripe_transfer_id = models.CharField(max_length=255, blank=True, db_index=True)
    failure = models.TextField(blank=True)
    requested_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-requested_at"]

    def __str__(self) -> str:
        return f"payout {self.pk} ({self.contributor}, {self.status})"


class PayoutAudit(models.Model):
    """Append-only: who did what to a payout, when, and why."""

    payout = models.ForeignKey(Payout, on_delete=models.PROTECT, related_name="audit")
    action = models.CharField(max_length=32)  # requested, approved, rejected, transferred, failed, reversed
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                              related_name="+")
    reason = models.TextField(blank=True)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"payout {self.payout_id} {self.action} by {self.actor or 'system'}"


class CreditAudit(models.Model):
    """Append-only: every manual credit (a `grant` on the ledger) with who gave it, to whom, how much, when and
    why. `actor` is empty for the automatic demo credit on sign-up (MUNINN_DEMO_CREDIT)."""

    transaction = models.OneToOneField(Transaction, on_delete=models.PROTECT, related_name="credit_audit")
    customer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    amount = models.BigIntegerField()  # nanos
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                              related_name="+")
    reason = models.TextField()
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"credit of {self.amount} nanos to {self.customer} by {self.actor or 'system'}"
