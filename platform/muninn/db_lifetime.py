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
"""
from __future__ import annotations

import random

from django.db.backends.signals import connection_created

SPREAD = 0.5  # a connection lives CONN_MAX_AGE × (1 ± SPREAD), uniformly


def spread_lifetime(sender, connection, **kwargs) -> None:
    max_age = connection.settings_dict.get("CONN_MAX_AGE")
    if not max_age or connection.close_at is None:  # closed after each request (0), or kept for good (None)
        return
    connection.close_at += max_age * random.uniform(-SPREAD, SPREAD)


def install() -> None:
    connection_created.connect(spread_lifetime, dispatch_uid="muninn.db_lifetime.spread_lifetime")
