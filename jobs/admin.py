from django.contrib import admin

from .models import Dataset, Job, Round, WorkUnit


@admin.register(Dataset)
class DatasetAdmin(admin.ModelAdmin):
    list_display = ("id", "name", "owner", "format", "size_bytes", "sensitive", "created_at")
    list_filter = ("sensitive",)
    readonly_fields = ("sha256", "profile", "sensitive")  # sensitivity is the customer's choice, made at upload


class RoundInline(admin.TabularInline):
    model = Round
    extra = 0
    fields = ("number", "status", "metrics", "opened_at", "closed_at")
    readonly_fields = fields


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("id", "owner", "template", "status", "current_round", "rounds", "created_at")
    list_filter = ("status", "template")
    inlines = [RoundInline]


@admin.register(WorkUnit)
class WorkUnitAdmin(admin.ModelAdmin):
    list_display = ("id", "round", "index", "status", "attempts", "lease_expires_at", "accepted_at")
    list_filter = ("status",)
