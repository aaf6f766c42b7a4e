"""The browser tier: what a device registered from /contribute/browser/ (backends ["browser"]) may be given.

A browser trains in JavaScript (static/muninn/browser/), CPU-class work checked by the site's CPU validator
like any other, but it runs only the templates written there, within the memory a tab can count on. Its
arithmetic is not torch's: its segments are judged at the tolerance measured for browser arithmetic
(contributors.tolerances, bench/browser_training.py). Reputation and pay are the same as for any device.
"""
from __future__ import annotations

from .models import Device

BACKEND = "browser"
TEMPLATES = ("mlp",)  # the templates static/muninn/browser/trainer.js trains
# The most a unit may need for a browser to be given it: a tab's heap is limited whatever the machine has, and
# navigator.deviceMemory (what the page reports) is a rounded hint, capped at 8 GB.
MAX_MEMORY_BYTES = 1 << 30


def is_browser(device: Device) -> bool:
    return BACKEND in ((device.capabilities or {}).get("backends") or [])


def templates_for(device: Device) -> tuple[str, ...] | None:
    """The templates the device may be leased units of: None (any) for a device running the worker client."""
    return TEMPLATES if is_browser(device) else None


def memory_for(device: Device) -> int:
    return min(device.memory_bytes, MAX_MEMORY_BYTES)


def backend_of(device: Device) -> str | None:
    """"browser" for a browser device (its segments' tolerance), None for one running torch."""
    return BACKEND if is_browser(device) else None
