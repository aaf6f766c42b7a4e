"""`make test` runs the suite on two pytest-xdist workers (scripts/test.sh). pytest-django already gives each worker
its own test database (test_muninn_gw0, test_muninn_gw1); this plugin, loaded with `-p tests.parallel` before
Django reads its settings, gives each its own Redis databases too, so that the live stacks two workers start at
once never take each other's Celery tasks or throttle counters. Worker gw<N> uses Redis database <base + 8N> as
its broker, modulo Redis's 16 databases (tests that need a second database use the broker's + 3:
tests/test_many_hosts.py)."""
from __future__ import annotations

import os

STRIDE = 8
DATABASES = 16  # Redis's default `databases`


def _isolate() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # set by xdist before the worker's pytest starts
    url = os.environ.get("CELERY_BROKER_URL", "")
    if not worker.startswith("gw") or not url.startswith(("redis://", "rediss://")):
        return
    base, _, db = url.rpartition("/")
    number = int(db) if db.isdigit() else 0
    os.environ["CELERY_BROKER_URL"] = f"{base}/{(number + STRIDE * int(worker[2:])) % DATABASES}"


_isolate()
