from django.apps import AppConfig


class BillingConfig(AppConfig):
    name = "billing"

    def ready(self) -> None:
        from . import receivers  # noqa: F401  (connects to jobs' signals)
