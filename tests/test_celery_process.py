"""How a Celery process treats what it keeps between tasks: its database connection and its torch threads
(muninn/celery.py). Celery's own Django fix-up would close every connection before and after each task; a
segment check then paid a new connection and a cold PostgreSQL backend each time."""
from types import SimpleNamespace

import pytest
import torch
from celery.fixups.django import DjangoWorkerFixup
from django.db import connection

from muninn import celery as muninn_celery


def _task(*, eager: bool) -> SimpleNamespace:
    return SimpleNamespace(request=SimpleNamespace(is_eager=eager))


def test_celerys_fixup_leaves_connections_open_between_tasks():
    assert DjangoWorkerFixup(muninn_celery.app).db_reuse_max >= 1_000_000


@pytest.mark.django_db(transaction=True)
def test_a_task_keeps_its_connection_unless_it_is_broken_or_too_old():
    if connection.vendor != "postgresql":
        pytest.skip("SQLite's CONN_MAX_AGE is 0: its connection is closed after every task, as Django's is")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]
    muninn_celery._close_old_connections(sender=_task(eager=False))  # after one task, before the next
    muninn_celery._close_old_connections(sender=_task(eager=False))
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        assert cursor.fetchone()[0] == backend  # the same backend: nothing reconnected

    connection.errors_occurred = True  # a query failed in the last task: the server had gone away
    connection.connection.close()
    muninn_celery._close_old_connections(sender=_task(eager=False))
    assert connection.connection is None  # closed: the next task's first query opens a fresh one
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        assert cursor.fetchone()[0] != backend


@pytest.mark.django_db
def test_an_eager_task_leaves_its_callers_connection_alone():
    before = connection.connection
    assert before is not None
    muninn_celery._close_old_connections(sender=_task(eager=True))
    assert connection.connection is before


def test_a_task_process_runs_torch_on_the_threads_it_is_given(settings):
    before = torch.get_num_threads()
    settings.MUNINN_TASK_TORCH_THREADS = 1
    try:
        torch.set_num_threads(2)
        muninn_celery._warm_up_torch()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
