"""Failpoints: named places in the code where a test can make a real process pause, so that a fault (kill -9, a
restart) lands at a chosen moment instead of after a guessed sleep. The idea of etcd's gofail and TiKV's fail-rs,
reduced to what the fault suite needs.

A failpoint does nothing unless the process's environment names it:

    MUNINN_WORKER_FAILPOINTS="upload.mid_body=sleep:30"                  (the worker client)
    MUNINN_FAILPOINTS="aggregate.before_commit=1*sleep:30;verify.before_commit=sleep:2"   (the site)

`NAME=ACTION` pairs are separated by `;`. The one action is `sleep:SECONDS`; a `N*` prefix limits it to the
first N times the point is reached (then it is off). Reaching an active failpoint prints one line to stderr,
`failpoint NAME reached: sleep 30s`, flushed, so a test can wait for that line and then inject its fault.

The environment is read once, at import; when it names nothing, `hit()` is one dictionary lookup.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

__all__ = ["Failpoints", "FailpointError", "parse", "failpoint", "WORKER_ENV"]

WORKER_ENV = "MUNINN_WORKER_FAILPOINTS"


class FailpointError(ValueError):
    """The failpoint variable cannot be parsed; raised at start-up so a typo is never silently ignored."""


@dataclass
class _Action:
    seconds: float
    remaining: int | None  # None: every time


def parse(spec: str) -> dict[str, _Action]:
    actions: dict[str, _Action] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, sep, action = item.partition("=")
        name, action = name.strip(), action.strip()
        count: int | None = None
        if "*" in action:
            times, _, action = action.partition("*")
            if not times.strip().isdigit() or int(times) < 1:
                raise FailpointError(f"failpoint {name!r}: the count before '*' must be a positive integer")
            count = int(times)
        kind, _, argument = action.partition(":")
        if not sep or not name or kind != "sleep":
            raise FailpointError(f"bad failpoint {item!r}: write NAME=sleep:SECONDS or NAME=N*sleep:SECONDS")
        try:
            seconds = float(argument)
        except ValueError:
            raise FailpointError(f"failpoint {name!r}: {argument!r} is not a number of seconds") from None
        actions[name] = _Action(seconds, count)
    return actions


class Failpoints:
    """The failpoints named by one environment variable."""

    def __init__(self, env_var: str, environ: dict[str, str] | None = None) -> None:
        self.env_var = env_var
        self._actions = parse((os.environ if environ is None else environ).get(env_var, ""))
        self._lock = threading.Lock()

    def hit(self, name: str) -> None:
        if not self._actions:
            return
        action = self._actions.get(name)
        if action is None:
            return
        with self._lock:
            if action.remaining is not None:
                if action.remaining == 0:
                    return
                action.remaining -= 1
        print(f"failpoint {name} reached: sleep {action.seconds:g}s", file=sys.stderr, flush=True)
        time.sleep(action.seconds)


_worker = Failpoints(WORKER_ENV)


def failpoint(name: str) -> None:
    """The worker client's failpoints (MUNINN_WORKER_FAILPOINTS)."""
    _worker.hit(name)
