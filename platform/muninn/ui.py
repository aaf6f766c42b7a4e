"""Template filters every page may use (a builtin library, see TEMPLATES in settings)."""
from __future__ import annotations

from django import template
from django.conf import settings

register = template.Library()


@register.filter
def money(nanos) -> str:
    """Integer nano-units of the currency, shown as the one money helper shows them (to the cent, or exactly
    when less than a cent)."""
    from billing.money import format_money

    return format_money(int(nanos or 0), settings.MUNINN_CURRENCY)


@register.filter
def money_exact(nanos) -> str:
    """Every digit of the amount (a statement's entries, a balance's tooltip)."""
    from billing.money import format_money

    return format_money(int(nanos or 0), settings.MUNINN_CURRENCY, exact=True)


@register.filter
def hu(flops) -> str:
    """FLOPs as hardware units (1 HU = 10^16 FLOPs), exact."""
    from jobs.hu import flops_to_hu, hu_str

    return hu_str(flops_to_hu(int(flops or 0)))


# Amounts in an error's detail are nano-units for programs; the message already says them in money.
MONEY_DETAIL_KEYS = frozenset({"price", "balance", "amount", "available", "minimum"})


@register.filter
def error_where(detail) -> list[str]:
    """An error's detail (row, column, file, field, ...) as short "name: value" lines for the page."""
    if not isinstance(detail, dict):
        return []
    return [f"{key.replace('_', ' ')}: {value}" for key, value in detail.items()
            if not isinstance(value, (dict, list)) and key not in MONEY_DETAIL_KEYS]


@register.filter
def duration(seconds) -> str:
    """An expected wall time in words (the same as the new-job page's script)."""
    if seconds is None:
        return "waiting for a capable device to come online"
    seconds = float(seconds)
    if seconds < 90:
        return f"about {round(seconds)} s"
    if seconds < 5400:
        return f"about {round(seconds / 60)} min"
    return f"about {seconds / 3600:.1f} h"


@register.filter
def get(mapping, key):
    return mapping.get(key) if isinstance(mapping, dict) else None
