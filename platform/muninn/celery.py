"""The Celery app: configured from Django settings (the CELERY_* names), tasks discovered per app."""
import logging
import os
import threading

from celery import Celery
from celery.signals import task_postrun, task_prerun, worker_process_init

from .broker import register as register_embedded_broker

register_embedded_broker()
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "muninn.settings")

app = Celery("muninn")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
log = logging.getLogger(__name__)


@worker_process_init.connect
def _on_process_start(**kwargs) -> None:
    """A process that runs tasks has started: warm torch up, then take start-up's objects out of the garbage
    collector's full passes (muninn_worker.heap: a 426 ms stop of the validator was measured mid-round)."""
    _warm_up_torch(freeze_heap=True)


def _warm_up_torch(*, freeze_heap: bool = False) -> None:
    """Each process that runs tasks pays torch's first-use costs (about a second) at start, not inside the first
    segment re-execution a round waits on (muninn_worker.training.warm_up). In a thread: a prefork child must
    report ready within seconds, and a task that arrives meanwhile simply runs beside it. First, the process's
    torch threads (settings.MUNINN_TASK_TORCH_THREADS: why one). `freeze_heap` once warmed up: only in a process
    of Celery's own, never in one that calls this (a test)."""
    import torch
    from django.conf import settings

    torch.set_num_threads(settings.MUNINN_TASK_TORCH_THREADS)

    def warm() -> None:
        from muninn_worker import heap
        from muninn_worker.training import warm_up

        seconds = warm_up()
        if freeze_heap:
            heap.freeze()
        log.info("torch warmed up in %.2f s", seconds)  # (what benchmarks and tests wait for: ready for rounds)

    threading.Thread(target=warm, name="muninn-warm-up", daemon=True).start()


@task_prerun.connect
@task_postrun.connect
def _close_old_connections(sender=None, **kwargs) -> None:
    """What Django does around each request, around each task: a connection that broke, or is older than
    CONN_MAX_AGE, is closed, and the next query opens a fresh one (settings.CELERY_DB_REUSE_MAX: why not all).
    Not for a task run eagerly inside its caller, whose transaction holds the connection."""
    if sender is not None and getattr(sender.request, "is_eager", False):
        return
    from django.db import close_old_connections

    close_old_connections()


def send_after_commit(send, *, what: str, sweeper: str) -> None:
    """Run `send` (it sends a Celery message) once the current transaction commits, at once outside one. The work
    the message is for is committed by then: a broker that refuses it (down, unreachable, its disk full) must not
    turn that work into an error for the request that did it, which a client would then retry. So the error is
    logged, and beat's `sweeper` does what the message would have (every message sent this way has one). With eager
    Celery (the tests) `send` runs the task itself, whose errors are not the broker's: they propagate."""
    from django.db import transaction

    def run() -> None:
        if app.conf.task_always_eager:
            send()
            return
        try:
            send()
        except Exception:  # noqa: BLE001 - not eager, so only the message's sending ran: the sweeper covers for it
            log.error("%s: the message was not sent (the broker refused it); beat's %s will do it", what, sweeper,
                      exc_info=True)

    transaction.on_commit(run)
