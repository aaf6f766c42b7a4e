"""The ledger in the admin: read-only (money moves through services only). Payout review is in contributors/admin.py,
next to the evidence it shows (devices, receipts)."""
from django.contrib import admin

from .models import Account, CreditAudit, Entry, Quote, StripeEvent, TopUp, Transaction


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class EntryInline(admin.TabularInline):
    model = Entry
    fields = ("account", "amount")
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Transaction)
class TransactionAdmin(ReadOnlyAdmin):
    list_display = ("id", "kind", "idempotency_key", "job", "unit", "payout", "created_by", "created_at", "memo")
    list_filter = ("kind",)
    search_fields = ("idempotency_key", "memo")
    inlines = [EntryInline]


@admin.register(CreditAudit)
class CreditAuditAdmin(ReadOnlyAdmin):
    list_display = ("at", "customer", "amount", "actor", "reason")
    search_fields = ("customer__username", "actor__username", "reason")


@admin.register(Account)
class AccountAdmin(ReadOnlyAdmin):
    list_display = ("key", "kind", "owner", "created_at")
    list_filter = ("kind",)
    search_fields = ("key", "owner__username")


@admin.register(Quote)
class QuoteAdmin(ReadOnlyAdmin):
    list_display = ("id", "customer", "template", "rounds", "price", "device_tier", "expires_at", "job")


@admin.register(TopUp)
class TopUpAdmin(ReadOnlyAdmin):
    list_display = ("id", "customer", "amount", "currency", "status", "stripe_session_id", "created_at", "paid_at")
    list_filter = ("status",)


@admin.register(StripeEvent)
class StripeEventAdmin(ReadOnlyAdmin):
    list_display = ("stripe_id", "type", "status", "received_at", "processed_at", "error")
    list_filter = ("status", "type")
