from django.contrib import admin

from . import services
from .models import Device, DeviceEvent, ExposurePolicy, Lease, Receipt, ShardDownload


class DeviceEventInline(admin.TabularInline):
    model = DeviceEvent
    extra = 0
    fields = ("at", "kind", "reason", "actor")
    readonly_fields = fields
    can_delete = False


class QuarantinedFilter(admin.SimpleListFilter):
    title = "quarantine"
    parameter_name = "quarantined"

    def lookups(self, request, model_admin):
        return [("yes", "Quarantined"), ("no", "In good standing")]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(quarantined_at__isnull=False)
        if self.value() == "no":
            return queryset.filter(quarantined_at__isnull=True)
        return queryset


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "owner", "verified_total", "verified_streak", "failures", "quarantined_at",
                    "quarantine_reason", "samples_per_s", "last_seen_at")
    list_filter = (QuarantinedFilter, "is_active")
    readonly_fields = ("token_hash", "public_key", "capabilities", "verified_streak", "verified_total", "failures",
                       "quarantined_at", "quarantine_reason")
    inlines = [DeviceEventInline]
    actions = ["lift_quarantine"]

    @admin.action(description="Lift the quarantine of the selected devices (after review)")
    def lift_quarantine(self, request, queryset):
        lifted = 0
        for device in queryset.filter(quarantined_at__isnull=False):
            services.device_lift_quarantine(device=device, staff=request.user,
                                            reason=f"lifted by {request.user.username} in the admin")
            lifted += 1
        self.message_user(request, f"Lifted the quarantine of {lifted} device(s).")


@admin.register(Receipt)
class ReceiptAdmin(admin.ModelAdmin):
    list_display = ("id", "unit", "device", "status", "reason", "samples", "loss_before", "loss_after", "created_at")
    list_filter = ("status",)
    readonly_fields = [f.name for f in Receipt._meta.fields]

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # receipts are evidence: immutable


admin.site.register(Lease)


@admin.register(ExposurePolicy)
class ExposurePolicyAdmin(admin.ModelAdmin):
    """The trust level for sensitive data (contributors.exposure): one row, which staff edit and never delete."""

    fields = ("min_verified_units", "min_device_age_days", "require_approved_owner", "approved_owners", "updated_at")
    readonly_fields = ("updated_at",)
    filter_horizontal = ("approved_owners",)

    def has_add_permission(self, request) -> bool:
        return not ExposurePolicy.objects.exists()

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(ShardDownload)
class ShardDownloadAdmin(admin.ModelAdmin):
    list_display = ("at", "job", "device", "owner", "unit", "peer_check", "shard_start", "shard_stop")
    list_filter = ("at",)
    readonly_fields = [f.name for f in ShardDownload._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # the customer's record of who had their rows: append-only


# --- Payout review ---------------------------------------------------------------------------------
# Here rather than in billing/: the evidence is the contributor's devices and receipts, and contributors/ sits
# above billing/ (it may use billing; billing never imports it).

from django.conf import settings  # noqa: E402
from django.contrib import messages  # noqa: E402
from django.db.models import Count, Q  # noqa: E402
from django.shortcuts import get_object_or_404, redirect  # noqa: E402
from django.template.response import TemplateResponse  # noqa: E402
from django.urls import path, reverse  # noqa: E402
from django.utils.html import format_html  # noqa: E402

from billing import money  # noqa: E402
from billing import payouts as billing_payouts  # noqa: E402
from billing import selectors as ledger  # noqa: E402
from billing import services as billing_services  # noqa: E402
from jobs.models import WorkUnit  # noqa: E402
from billing.models import Payout, PayoutAccount, Transaction  # noqa: E402
from muninn.errors import MuninnError  # noqa: E402


def _held(charge: Transaction) -> bool:
    """Whether the charge's earnings are held for review now (from the prefetched follow-ups)."""
    kinds = [f.kind for f in charge.followups.all()]
    return (Transaction.Kind.FORFEIT not in kinds
            and kinds.count(Transaction.Kind.EARNINGS_HOLD) > kinds.count(Transaction.Kind.EARNINGS_RELEASE))


def payout_evidence(payout: Payout) -> dict:
    """What a reviewer needs: the contributor's devices with their record, the charges behind the earnings with
    the receipts that were accepted for them, rejected results, earlier payouts."""
    contributor = payout.contributor
    devices = Device.objects.filter(owner=contributor).annotate(
        accepted=Count("receipts", filter=Q(receipts__status=Receipt.Status.ACCEPTED)),
        rejected=Count("receipts", filter=Q(receipts__status=Receipt.Status.REJECTED))).order_by("id")
    charges = []
    txns = (Transaction.objects.filter(kind=Transaction.Kind.CHARGE, entries__account__owner=contributor)
            .select_related("unit__round").prefetch_related("entries__account", "followups").order_by("-id")[:200])
    for txn in txns:
        earned = sum(e.amount for e in txn.entries.all() if e.account.owner_id == contributor.pk)
        charges.append({
            "txn": txn, "round": txn.unit.round.number if txn.unit_id else None,
            "earned": earned,
            "receipt": Receipt.objects.filter(unit_id=txn.unit_id, status=Receipt.Status.ACCEPTED).first(),
            "cleared": any(f.kind == Transaction.Kind.CLEAR for f in txn.followups.all()),
            "forfeited": any(f.kind == Transaction.Kind.FORFEIT for f in txn.followups.all()),
            "held": _held(txn),
        })
    return {
        "devices": devices, "charges": charges,
        "rejected": Receipt.objects.filter(device__owner=contributor, status=Receipt.Status.REJECTED)
        .order_by("-id")[:50],
        "earlier": Payout.objects.filter(contributor=contributor).exclude(pk=payout.pk).order_by("-requested_at"),
        "balances": sorted((k, money.format_money(v, payout.currency))
                           for k, v in ledger.balances_for(user=contributor).items()),
        "payout_account": PayoutAccount.objects.filter(contributor=contributor).first(),
    }


@admin.register(Payout)
class PayoutAdmin(admin.ModelAdmin):
    list_display = ("id", "contributor", "amount_display", "status", "requested_at", "reviewed_by", "reviewed_at",
                    "review_link")
    list_filter = ("status",)
    readonly_fields = [f.name for f in Payout._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def _reviewer(self, request) -> bool:  # staff review payouts by their role, without per-model permissions
        return request.user.is_active and (request.user.is_superuser or getattr(request.user, "role", "") == "staff")

    def has_module_permission(self, request) -> bool:
        return self._reviewer(request)

    def has_view_permission(self, request, obj=None) -> bool:
        return self._reviewer(request)

    def has_change_permission(self, request, obj=None) -> bool:
        return self._reviewer(request)

    @admin.display(description="amount")
    def amount_display(self, payout: Payout) -> str:
        return money.format_money(payout.amount, payout.currency)

    @admin.display(description="review")
    def review_link(self, payout: Payout) -> str:
        return format_html('<a href="{}">review</a>', reverse("admin:billing_payout_review", args=[payout.pk]))

    def get_urls(self):
        return [path("<int:payout_id>/review/", self.admin_site.admin_view(self.review_view),
                     name="billing_payout_review")] + super().get_urls()

    def review_view(self, request, payout_id: int):
        """The evidence, and approve (→ Stripe transfer) or reject with a reason; or forfeit one unit's earnings
        before they clear. Decided by the services, which lock the rows: two reviewers deciding at once, one wins
        and the other is told."""
        payout = get_object_or_404(Payout.objects.select_related("contributor", "reviewed_by"), pk=payout_id)
        if request.method == "POST":
            if not self.has_change_permission(request, payout):
                messages.error(request, "You may not review payouts.")
                return redirect(request.path)
            reason = request.POST.get("reason", "")
            try:
                if request.POST.get("decision") == "forfeit":
                    unit = get_object_or_404(WorkUnit, pk=request.POST.get("unit") or 0)
                    billing_services.earnings_forfeit(unit=unit, staff=request.user, reason=reason)
                    messages.success(request, f"The earnings of unit {unit.pk} were forfeited and refunded.")
                elif request.POST.get("decision") == "approve":
                    payout = billing_payouts.payout_approve(payout_id=payout.pk, staff=request.user, reason=reason)
                    level = messages.SUCCESS if payout.status == Payout.Status.PAID else messages.WARNING
                    messages.add_message(request, level, f"Payout {payout.pk}: {payout.get_status_display()}.")
                else:
                    billing_payouts.payout_reject(payout_id=payout.pk, staff=request.user, reason=reason)
                    messages.success(request, f"Payout {payout.pk} rejected.")
            except MuninnError as e:
                messages.error(request, e.message)
            return redirect(request.path)
        context = {**self.admin_site.each_context(request), "title": f"Review payout {payout.pk}", "payout": payout,
                   "amount": money.format_money(payout.amount, payout.currency or settings.MUNINN_CURRENCY),
                   "opts": self.model._meta, **payout_evidence(payout)}
        return TemplateResponse(request, "admin/billing/payout_review.html", context)
