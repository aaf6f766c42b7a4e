"""Template filters every page may use (a builtin library, see TEMPLATES in settings)."""
from __future__ import annotations

from django import template
from django.conf import settings

register = template.Library()


@register.filter
def money(nanos) -> str:
    """Integer nano-units of the currency, shown as the one money helper shows them."""
    from billing.money import format_money

    return format_money(int(nanos or 0), settings.MUNINN_CURRENCY)


@register.filter
def hu(flops) -> str:
    """FLOPs as hardware units (1 HU = 10^16 FLOPs), exact."""
    from jobs.hu import flops_to_hu, hu_str

    return hu_str(flops_to_hu(int(flops or 0)))


@register.filter
def error_where(detail) -> list[str]:
    """An error's detail (row, column, file, field, ...) as short "name: value" lines for the page."""
    if not isinstance(detail, dict):
        return []
    return [f"{key.replace('_', ' ')}: {value}" for key, value in detail.items() if not isinstance(value, (dict, list))]


@register.filter
def get(mapping, key):
    return mapping.get(key) if isinstance(mapping, dict) else None
