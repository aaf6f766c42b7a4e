"""`make test` runs the suite on two pytest-xdist workers (scripts/test.sh). pytest-django already gives each worker
its own test database (test_muninn_gw0, test_muninn_gw1); this plugin, loaded with `-p tests.parallel` before
Django reads its settings, gives each its own Redis databases too, so that the live stacks two workers start at
once never take each other's Celery tasks or throttle counters. Worker gw<N> uses Redis database <base + 8N> as
its broker, modulo Redis's 16 databases (tests that need a second database use the broker's + 3:
tests/test_many_hosts.py).

It also orders the files: the few that each take minutes (live stacks of many processes) first, so that they run
beside the rest instead of alone at the end. `make test` passes --no-loadscope-reorder, under which xdist's
`--dist loadfile` hands files out in collection order (its default puts the files with most tests first, which
left the attack suite, one test of five minutes, for last on one worker while the other sat idle)."""
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

# The slowest files in the last fresh-clone runs (--durations), slowest first.
SLOW_FIRST = ("tests/test_attacks.py", "tests/test_api_contract.py", "tests/test_run_script.py",
              "tests/test_fresh_install.py", "tests/test_e2e_verification.py", "tests/test_many_hosts.py",
              "tests/test_e2e.py")


def pytest_collection_modifyitems(items) -> None:
    """The SLOW_FIRST files first, in that order; every other file, and every file's tests, in collection order."""
    rank = {path: n for n, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # a stable sort
