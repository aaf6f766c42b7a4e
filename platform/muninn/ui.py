"""Template filters every page may use (a builtin library, see TEMPLATES in settings)."""
from __future__ import annotations

from django import template
from django.conf import settings
from django.utils.html import format_html

from . import figures

register = template.Library()


def _figure(text: str, title: str) -> str:
    return format_html('<span class="figure-value" title="{}">{}</span>', title, text)


@register.filter
def money(nanos) -> str:
    """Integer nano-units of the currency to the cent ("< €0.01" for less), every digit in the tooltip."""
    nanos = int(nanos or 0)
    return _figure(figures.money_text(nanos, settings.MUNINN_CURRENCY),
                   figures.money_title(nanos, settings.MUNINN_CURRENCY))


@register.filter
def money_exact(nanos) -> str:
    """Every digit of the amount, as plain text (a statement's entries, a tooltip)."""
    return figures.money_exact(int(nanos or 0), settings.MUNINN_CURRENCY)


@register.filter
def hu(flops) -> str:
    """FLOPs as work people read (1.24 HU, 3.1 mHU, 512 MFLOP), the exact HU and FLOPs in the tooltip."""
    flops = int(flops or 0)
    return _figure(figures.hu_text(flops), figures.hu_title(flops))


@register.filter
def hu_exact(flops) -> str:
    """FLOPs as the exact HU and FLOPs, as plain text (the statement)."""
    return figures.hu_exact(int(flops or 0))


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
