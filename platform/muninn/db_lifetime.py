"""Each database connection's lifetime spread around CONN_MAX_AGE, so that connections opened together are not all
closed and opened again together.

A web process's threads (and a fresh deployment's processes) open their connections within the first second or two
of serving, and Django closes a connection at the end of the first request after its CONN_MAX_AGE: with a fixed age,
every connection of the site reconnects in the same second, once a minute, for as long as the site runs. Each
reconnect costs a new PostgreSQL backend (its start and its first look at the catalogs) and the worker API's
statements prepared again (muninn/sql.py): measured on the 2-core dev machine, ~1.2 ms of the process's CPU and
~6.5 ms of PostgreSQL's for the connection and its first two queries, before any statement is prepared again; a
host's 24 connections (3 processes × 8 threads) pay ~0.19 s of CPU in the same second. Under bench/load.py with phases
long enough to reach the age (`--seconds 60`), two pairs in turns gave the paced phase a p99 of 316 and 450 ms with
the fixed age against 108 and 275 ms with connections kept longer than the run; later, in a slower spell, the spread
age gave 392 and 360 ms against 470: suggestive, not shown, in this VM's noise (docs/benchmarks.md, the nineteenth
session). Spread over ±SPREAD of the age, the reconnects drift apart and stay apart; the mean age, and so how often
a connection is renewed, is unchanged.

And each PostgreSQL connection is closed when the thread that opened it ends. A web server's request threads come and
go (granian's blocking threads end after an idle spell, 30 s by default, and new ones start with the next burst);
Django keeps a thread's connection in that thread's storage, which Python releases when the thread ends, but the
connection's objects hold reference cycles, so it stayed open, a PostgreSQL backend idle for good, until the garbage
collector's next full pass, which a web process rarely makes (its heap is frozen: muninn_worker.heap). Measured under
granian (one worker, 8 threads, a 5-s idle timeout): 7 more backends after every burst that followed an idle spell, 22
after three, still 22 after 75 s and 900 more requests; a site with bursty devices runs PostgreSQL out of connections
(max_connections, 100 by default). `_ThreadConnections`, in a thread-local of its own and free of cycles, is released
the moment the thread ends, and closes them.
"""
from __future__ import annotations

import logging
import random
import threading

from django.db.backends.signals import connection_created

log = logging.getLogger(__name__)

SPREAD = 0.5  # a connection lives CONN_MAX_AGE × (1 ± SPREAD), uniformly


def spread_lifetime(sender, connection, **kwargs) -> None:
    max_age = connection.settings_dict.get("CONN_MAX_AGE")
    if not max_age or connection.close_at is None:  # closed after each request (0), or kept for good (None)
        return
    connection.close_at += max_age * random.uniform(-SPREAD, SPREAD)


class _ThreadConnections:
    """The PostgreSQL connections (the driver's, by alias) a thread opened; closes them when the thread ends and
    Python releases the thread's storage. No reference cycles (nothing here refers back to it), so that happens at
    once, not at a pass of the garbage collector."""

    __slots__ = ("raw",)

    def __init__(self) -> None:
        self.raw: dict[str, object] = {}

    def __del__(self) -> None:
        for raw in self.raw.values():
            try:
                raw.close()  # psycopg: a no-op when Django closed it already (its age, an error)
            except Exception:  # a thread's end is no place to raise (the backend ends with the socket anyway)
                log.debug("closing a finished thread's database connection failed", exc_info=True)


_thread = threading.local()


def close_with_thread(sender, connection, **kwargs) -> None:
    if connection.vendor != "postgresql":  # SQLite's is a file handle: no server-side backend to hold
        return
    held = getattr(_thread, "connections", None)
    if held is None:
        held = _thread.connections = _ThreadConnections()
    held.raw[connection.alias] = connection.connection  # (a reconnect's replaces the closed one)


def install() -> None:
    connection_created.connect(spread_lifetime, dispatch_uid="muninn.db_lifetime.spread_lifetime")
    connection_created.connect(close_with_thread, dispatch_uid="muninn.db_lifetime.close_with_thread")
