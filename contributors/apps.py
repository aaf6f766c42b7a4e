from django.apps import AppConfig


class ContributorsConfig(AppConfig):
    name = "contributors"

    def ready(self) -> None:
        from . import receivers  # noqa: F401  (connects to jobs' signals)
