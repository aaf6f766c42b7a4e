"""Wake-ups for devices waiting on a claim: "units were queued" told from whichever process queued them (the
Celery worker opening a round, beat re-queueing an expired lease, a web thread releasing a refused result) to the
web processes holding long-poll claims (contributors/push.py).

Two carriers, chosen from the settings:

- **Redis** (MUNINN_WAKEUP_REDIS_URL, by default the Celery broker's URL when that is Redis): a PUBLISH on one
  channel. Each web process keeps one subscriber thread that wakes all of its waiting claims.
- **A stamp file** otherwise (the embedded defaults: SQLite and the filesystem broker, one machine): publishing
  rewrites `<MUNINN_VAR_DIR>/wakeups/units-queued`; a waiting claim looks at its modification time every
  STAMP_POLL_S, a stat() that costs next to nothing, and re-runs the claim only when it moved.

Either way a wake-up is only a hint: the waiter runs the real claim, and also re-checks every
MUNINN_CLAIM_RECHECK_SECONDS, for what no event announces (a refused unit's backoff running out, a reservation
lapsing) and for wake-ups lost with a Redis connection or published on another machine.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

from django.conf import settings
from django.db import transaction

log = logging.getLogger(__name__)

CHANNEL = "muninn:units-queued"
STAMP_POLL_S = 0.03
_stopping = threading.Event()  # the process is shutting down: waiting claims answer at once


def units_queued() -> None:
    """Tell waiting claims that units were queued. Call it after the commit that queued them (see
    units_queued_on_commit); never raises: a lost wake-up costs a waiter one re-check interval."""
    try:
        _carrier().publish()
    except Exception:  # noqa: BLE001 - a hint; the re-check covers for it
        log.warning("could not publish a units-queued wake-up", exc_info=True)


def units_queued_on_commit() -> None:
    """units_queued once the current transaction commits (at once outside one)."""
    transaction.on_commit(units_queued)


def mark() -> object:
    """A token for "now": wait(token, ...) returns early for anything published after it."""
    return _carrier().mark()


def wait(token: object, timeout: float) -> object:
    """Block until something is published after `token`, the process stops, or `timeout` seconds pass. Returns
    the new token."""
    if _stopping.is_set():
        return token
    return _carrier().wait(token, timeout)


def warm_up() -> None:
    """Make this process's carrier now (importing redis for the Redis one: ~0.1 s alone, ~0.8 s measured inside
    a first long-poll claim under bench/round_latency.py's 10 devices), not in the first claim that waits."""
    _carrier()


def stopping() -> bool:
    return _stopping.is_set()


def stop() -> None:
    """The process is stopping: every held claim returns now (its device gets a 204 and claims again, from another
    process or once the site is back), and none waits from here on. Safe in a signal handler: the waiters are
    woken from a thread of its own, which takes the carriers' locks (the interrupted thread may hold one)."""
    _stopping.set()
    threading.Thread(target=_wake_all, name="muninn-wakeups-stop", daemon=True).start()


def _wake_all() -> None:
    for carrier in list(_carriers.values()):
        carrier.wake_all()


def stop_waiting_on_sigterm() -> None:
    """End held claims when the web server tells this worker process to stop (SIGTERM), so a graceful shutdown is
    not held up for the rest of every device's wait. Chains to the handler installed already (gunicorn's own);
    does nothing where SIGTERM has no Python handler (runserver, a plain process) or off the main thread. granian
    installs its own after the application has loaded, replacing this one: muninn/serve.py (how the site runs
    granian) chains this one back in."""
    previous = signal.getsignal(signal.SIGTERM)
    if not callable(previous) or threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        stop()
        previous(signum, frame)

    signal.signal(signal.SIGTERM, handler)


# --- carriers -------------------------------------------------------------------------------------------------

class _Stamp:
    """A file whose modification time moves on every publish (single machine, no server needed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def publish(self) -> None:
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_bytes(str(time.time_ns()).encode())
        os.replace(tmp, self.path)  # a new inode each time: the token changes even within one mtime tick

    def mark(self) -> object:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns)

    def wait(self, token: object, timeout: float) -> object:
        deadline = time.monotonic() + timeout
        while True:
            now = self.mark()
            if now != token or _stopping.is_set():
                return now
            left = deadline - time.monotonic()
            if left <= 0:
                return now
            time.sleep(min(STAMP_POLL_S, left))

    def wake_all(self) -> None:
        pass  # a waiter looks at _stopping every STAMP_POLL_S


class _Redis:
    """PUBLISH to a channel; one subscriber thread per process turns messages into a generation count."""

    def __init__(self, url: str) -> None:
        import redis

        self._client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        self._url = url
        self._changed = threading.Condition()
        self._generation = 0
        self._listener: threading.Thread | None = None
        self._pid = os.getpid()

    def publish(self) -> None:
        self._client.publish(CHANNEL, b"1")

    def mark(self) -> object:
        self._ensure_listener()
        with self._changed:
            return self._generation

    def wait(self, token: object, timeout: float) -> object:
        self._ensure_listener()
        with self._changed:
            self._changed.wait_for(lambda: self._generation != token or _stopping.is_set(), timeout)
            return self._generation

    def _ensure_listener(self) -> None:
        if self._listener is not None and self._listener.is_alive() and self._pid == os.getpid():
            return
        with self._changed:
            if self._listener is None or not self._listener.is_alive() or self._pid != os.getpid():
                self._pid = os.getpid()
                self._listener = threading.Thread(target=self._listen, name="muninn-wakeups", daemon=True)
                self._listener.start()

    def _listen(self) -> None:
        import redis

        while True:
            try:
                pubsub = redis.Redis.from_url(self._url, socket_connect_timeout=2,
                                              health_check_interval=30).pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(CHANNEL)
                self._bump()  # anything published while we were not listening: let the waiters look
                while True:  # get_message with a timeout, not listen(): a dead connection is noticed (health check)
                    message = pubsub.get_message(timeout=10.0)
                    if message is not None and message.get("type") == "message":
                        self._bump()
            except Exception:  # noqa: BLE001 - reconnect; waiters meanwhile fall back to their re-check
                log.warning("the wake-up subscriber lost Redis; reconnecting", exc_info=True)
                time.sleep(1.0)

    def wake_all(self) -> None:
        with self._changed:  # each waiter re-checks its predicate, which sees _stopping
            self._changed.notify_all()

    def _bump(self) -> None:
        with self._changed:
            self._generation += 1
            self._changed.notify_all()


_carriers: dict[tuple[str, str], _Stamp | _Redis] = {}
_carriers_lock = threading.Lock()


def _carrier() -> _Stamp | _Redis:
    url = settings.MUNINN_WAKEUP_REDIS_URL
    key = ("redis", url) if url else ("stamp", str(Path(settings.MUNINN_WAKEUP_DIR) / "units-queued"))
    carrier = _carriers.get(key)
    if carrier is None:
        with _carriers_lock:
            carrier = _carriers.get(key)
            if carrier is None:
                carrier = _carriers[key] = _Redis(url) if url else _Stamp(Path(key[1]))
    return carrier
