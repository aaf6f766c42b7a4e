from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"

    def ready(self) -> None:
        from muninn import db_lifetime

        from . import tasks  # noqa: F401  (its receivers enqueue what jobs' signals call for)

        db_lifetime.install()  # every process of the site (web, Celery, beat) loads this app
