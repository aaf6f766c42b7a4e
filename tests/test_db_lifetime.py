"""muninn/db_lifetime.py: connections opened together do not all reach CONN_MAX_AGE, and reconnect, together; and a
thread's PostgreSQL connections close when the thread ends (a web server's idle request threads)."""
import concurrent.futures
import gc
import os
import signal
import subprocess
import sys
import threading
import time

import psycopg
import pytest
import requests
from django.db import DEFAULT_DB_ALIAS, connection, connections

from scripts.stack import ROOT, base_env, free_port, wait_http

from muninn import db_lifetime

from .test_e2e import database_url


def _lifetimes(max_age, count: int = 20) -> list[float | None]:
    """Open `count` connections one after another, as a web process's threads do as it starts serving, with this
    CONN_MAX_AGE: how long each is to live."""
    settings_dict = {**connections.settings[DEFAULT_DB_ALIAS], "CONN_MAX_AGE": max_age}
    wrapper_class = type(connections[DEFAULT_DB_ALIAS])
    lifetimes = []
    for _ in range(count):
        conn = wrapper_class(settings_dict, DEFAULT_DB_ALIAS)
        try:
            conn.ensure_connection()
            lifetimes.append(None if conn.close_at is None else conn.close_at - time.monotonic())
        finally:
            conn.close()
    return lifetimes


@pytest.mark.django_db
def test_connections_opened_together_live_spread_lifetimes_around_the_max_age():
    lifetimes = _lifetimes(60)

    low, high = 60 * (1 - db_lifetime.SPREAD) - 1, 60 * (1 + db_lifetime.SPREAD)
    assert all(low <= age <= high for age in lifetimes), lifetimes  # never far from the age asked for
    assert max(lifetimes) - min(lifetimes) > 15, lifetimes  # not all at once (uniform over 60 s: a range of ~57)


@pytest.mark.django_db
@pytest.mark.parametrize("max_age", [0, None])
def test_connections_closed_after_each_request_or_kept_for_good_are_left_so(max_age):
    lifetimes = _lifetimes(max_age, count=3)

    if max_age is None:
        assert lifetimes == [None, None, None]
    else:
        assert all(age <= 0 for age in lifetimes), lifetimes


def _backends_alive(pids: list[int], *, within: float = 10.0) -> list[int]:
    """Those of the PostgreSQL backends `pids` still there after up to `within` s (a closed connection's backend
    ends a moment after its client says goodbye)."""
    deadline = time.monotonic() + within
    while True:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)", [pids])
            alive = [pid for pid, in cursor.fetchall()]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.django_db(transaction=True)
def test_a_threads_connection_closes_when_the_thread_ends_not_at_the_collectors_next_pass():
    if connection.vendor != "postgresql":
        pytest.fail("this test needs PostgreSQL: run it through `make test` (DATABASE_URL=postgres://...)")
    pids = []

    def serve_one_request() -> None:  # as a web server's request thread does, then ends
        with connections[DEFAULT_DB_ALIAS].cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pids.append(cursor.fetchone()[0])

    gc.disable()  # what closes them is not the garbage collector (a web process rarely makes a full pass)
    try:
        threads = [threading.Thread(target=serve_one_request) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(set(pids)) == 4
        assert _backends_alive(pids) == []
    finally:
        gc.enable()


@pytest.mark.django_db(transaction=True)
def test_granians_idle_request_threads_leave_no_database_connection_behind(tmp_path):
    """The live site under granian, whose blocking threads end after an idle spell (5 s here, 30 s by default): bursts
    of requests with idle spells between them. Each burst's new threads open connections; the ended threads' must
    close, or PostgreSQL's backends grow by a burst's threads every time (7 a burst, for good, before the fix)."""
    if connection.vendor != "postgresql":
        pytest.fail("this test needs PostgreSQL: run it through `make test` (DATABASE_URL=postgres://...)")
    name, url = connection.settings_dict["NAME"], database_url()
    port = free_port()
    env = base_env(DATABASE_URL=url, DEBUG="0", SECRET_KEY="x" * 50, ALLOWED_HOSTS="127.0.0.1", MUNINN_TLS="false",
                   MEDIA_ROOT=str(tmp_path / "media"), MUNINN_VAR_DIR=str(tmp_path / "var"), CONN_MAX_AGE="600")
    log = tmp_path / "web.log"  # (a pipe nobody reads fills with the request log, and the server stops on it)
    server = subprocess.Popen(
        [sys.executable, "-m", "muninn.serve", "--interface", "wsgi", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--blocking-threads", "8", "--blocking-threads-idle-timeout", "5",
         "--workers-kill-timeout", "5", "muninn.wsgi:application"],
        cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def backends() -> int:
        with psycopg.connect(url) as admin:  # (its own backend is not counted: the query's is excluded)
            return admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                                 "AND pid <> pg_backend_pid()", [name]).fetchone()[0]

    def claim(_) -> int:  # a device token the site looks up: every request uses the thread's connection
        return requests.post(f"http://127.0.0.1:{port}/api/worker/claim", timeout=30,
                             headers={"Authorization": "Device not-a-device"}).status_code

    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        before = backends()  # (this test's own connection)
        after_bursts = []
        for _ in range(3):
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                assert set(pool.map(claim, range(160))) == {401}
            after_bursts.append(backends() - before)
            time.sleep(7)  # longer than the idle timeout: the burst's threads end
        assert max(after_bursts) <= 8, (after_bursts, log.read_text()[-2000:])  # never more than its threads
        deadline = time.monotonic() + 10
        while backends() - before > 1 and time.monotonic() < deadline:  # (the one thread granian keeps)
            time.sleep(0.2)
        assert backends() - before <= 1, (after_bursts, log.read_text()[-2000:])
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            pytest.fail(f"the server did not stop within 30 s of SIGTERM; its log:\n{log.read_text()[-3000:]}")
