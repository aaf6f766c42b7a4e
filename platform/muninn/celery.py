"""The Celery app: configured from Django settings (the CELERY_* names), tasks discovered per app."""
import os

from celery import Celery

from .broker import register as register_embedded_broker

register_embedded_broker()
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "muninn.settings")

app = Celery("muninn")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
