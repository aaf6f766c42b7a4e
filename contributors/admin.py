from django.contrib import admin

from . import services
from .models import Device, DeviceEvent, Lease, Receipt


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
