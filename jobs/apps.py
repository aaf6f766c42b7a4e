from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"

    def ready(self) -> None:
        from . import tasks  # noqa: F401  (its receivers enqueue what jobs' signals call for)
