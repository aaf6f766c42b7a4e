from django.contrib import admin

from .models import Device, Lease, Receipt


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "owner", "memory_bytes", "samples_per_s", "is_active", "last_seen_at")
    list_filter = ("is_active",)
    readonly_fields = ("token_hash", "capabilities")


@admin.register(Receipt)
class ReceiptAdmin(admin.ModelAdmin):
    list_display = ("id", "unit", "device", "status", "reason", "samples", "loss_before", "loss_after", "created_at")
    list_filter = ("status",)

    def has_change_permission(self, request, obj=None) -> bool:
        return False  # receipts are evidence: immutable


admin.site.register(Lease)
