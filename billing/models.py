"""A double-entry ledger: transactions of entries that sum to zero, append-only; balances are derived."""
from django.conf import settings
from django.db import models


class Account(models.Model):
    class Kind(models.TextChoices):
        CUSTOMER_AVAILABLE = "customer_available", "Customer balance"
        CUSTOMER_HELD = "customer_held", "Customer held for jobs"
        CONTRIBUTOR_PENDING = "contributor_pending", "Contributor pending earnings"
        PLATFORM_FEE = "platform_fee", "Platform fees"
        PLATFORM_GRANTS = "platform_grants", "Manual credits granted by staff"

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
        HOLD = "hold", "Hold for a job"
        CHARGE = "charge", "Charge for verified work"
        RELEASE = "release", "Release of an unused hold"
        FORFEIT = "forfeit", "Earnings forfeited (untrustworthy work), refunded"

    idempotency_key = models.CharField(max_length=200, unique=True)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    memo = models.CharField(max_length=500, blank=True)
    job = models.ForeignKey("jobs.Job", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    unit = models.ForeignKey("jobs.WorkUnit", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    flops = models.BigIntegerField(default=0)  # the work a charge pays for (HU = flops / 10^16)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]

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
