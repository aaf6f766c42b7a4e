"""How far an honest segment may land from the validator's re-training of it: measured, not a constant.

`bench/verification.py` trains honest segments of every template under another device's arithmetic (the
float64-rounded-to-float32 stand-in, which tracks a real GPU against a CPU: shared measurements) and writes
the worst relative distance it saw per template and segment length to `data/tolerances.json`: the envelope.
A segment passes when its distance is at most MULTIPLE × that envelope (never below the floor, which covers a
validator with another thread count). Each template also has its segment length: the longest whose honest
envelope stays far from every cheat the calibration tries and whose verification overhead stays within the
goal (`segment_steps`). The envelopes also cover a real H100's segments against its CPU. A browser device's
arithmetic (static/muninn/browser/, JavaScript) was measured on its own by bench/browser_training.py (the table's
"browser" part): its segments are judged against the larger of the two envelopes. Pure: reads one JSON file.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

from muninn_worker.segments import MAX_SEGMENTS

DATA = Path(__file__).resolve().parent / "data" / "tolerances.json"


@lru_cache(maxsize=1)
def table() -> dict:
    return json.loads(DATA.read_text())


def segment_steps(template: str) -> int:
    """The segment length k a new job of this template is given."""
    return int(_template(template)["segment_steps"])


def segment_steps_for(template: str, unit_steps: int) -> int:
    """k for one unit: the template's, made longer only when the unit has more segments than a receipt may
    commit to (muninn_worker.segments.MAX_SEGMENTS)."""
    return max(segment_steps(template), math.ceil(unit_steps / MAX_SEGMENTS))


def envelope(template: str, k: int) -> float:
    """The honest envelope at k steps: measured at the smallest calibrated length ≥ k (the longest when k is
    past them all; drift grows with k, so a shorter length's envelope would be too tight)."""
    return _at_length(_template(template)["envelope"], k)


def _at_length(envelopes: dict, k: int) -> float:
    """{k as in the table: envelope} read at the smallest calibrated length ≥ k, else the longest."""
    measured = {int(steps): float(value) for steps, value in envelopes.items()}
    return measured[min((steps for steps in measured if steps >= k), default=max(measured))]


def browser_envelope(template: str, k: int) -> float:
    """The envelope measured for browser arithmetic at k (0 where the browser tier has no measurement)."""
    measured = table().get("browser", {}).get("templates", {}).get(template, {}).get("envelope", {})
    return _at_length(measured, k) if measured else 0.0


def tolerance(template: str, k: int, backend: str | None = None) -> float:
    """How far a segment of k steps may land from the validator's. `backend` "browser": a browser device's,
    judged against the larger of the template's envelope and the one measured for browser arithmetic."""
    data = table()
    measured = envelope(template, k)
    if backend == "browser":
        measured = max(measured, browser_envelope(template, k))
    return max(float(data["floor"]), float(data["multiple"]) * measured)


def _template(template: str) -> dict:
    templates = table()["templates"]
    if template not in templates:
        raise KeyError(f"no calibrated tolerance for template {template!r}: run bench/verification.py")
    return templates[template]
