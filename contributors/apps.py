from django.apps import AppConfig


class ContributorsConfig(AppConfig):
    name = "contributors"
