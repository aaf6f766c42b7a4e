"""The Celery app: configured from Django settings (the CELERY_* names), tasks discovered per app."""
import logging
import os
import threading

from celery import Celery
from celery.signals import worker_process_init

from .broker import register as register_embedded_broker

register_embedded_broker()
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "muninn.settings")

app = Celery("muninn")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
log = logging.getLogger(__name__)


@worker_process_init.connect
def _warm_up_torch(**kwargs) -> None:
    """Each process that runs tasks pays torch's first-use costs (about a second) at start, not inside the first
    segment re-execution a round waits on (muninn_worker.training.warm_up). In a thread: a prefork child must
    report ready within seconds, and a task that arrives meanwhile simply runs beside it."""
    def warm() -> None:
        from muninn_worker.training import warm_up

        log.info("torch warmed up in %.2f s", warm_up())

    threading.Thread(target=warm, name="muninn-warm-up", daemon=True).start()
