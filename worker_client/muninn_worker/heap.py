"""Keep the garbage collector's full passes short in long-running processes that have torch loaded.

Python's collector walks every tracked object on a full (generation 2) pass. With torch and Django imported a
process holds ~250,000 of them, and a full pass takes 120-430 ms on a 2-core VM. It runs every few seconds in a
busy process, and the whole process stops while it does. Measured during `bench/round_latency.py` rounds: the web
stopped for 120-240 ms about every 3 s, the validator for 426 ms once in a job, and one such pause added ~0.25 s
to a round's segment check.

`freeze()` moves everything alive at start-up (modules, classes, functions, torch's op registry) into the permanent
generation, which full passes skip (`gc.freeze`, the technique Instagram's Django servers use). A full pass then
walks only what was made after: 11-66 ms under `bench/load.py`. Objects frozen are never collected; start-up
objects live as long as the process anyway."""
from __future__ import annotations

import gc


def freeze() -> int:
    """Collect what start-up left behind, then exempt every object alive now from the collector's full passes.
    Call once start-up is over (imports done, torch warmed up). Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
