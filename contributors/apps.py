from django.apps import AppConfig


class ContributorsConfig(AppConfig):
    name = "contributors"

    def ready(self) -> None:
        from . import exposure, receivers, tasks  # noqa: F401  (connect to jobs' and contributors' signals)
