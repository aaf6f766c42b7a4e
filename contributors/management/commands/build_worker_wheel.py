"""Build the worker client's wheel the site serves at /downloads/ (contributors/wheel.py), ahead of the first
download: at release, on each machine that serves it (or once, with MUNINN_WORKER_WHEEL pointing at the file)."""
from django.core.management.base import BaseCommand, CommandError

from contributors import wheel


class Command(BaseCommand):
    help = "Build the worker client's wheel served at /downloads/ and print its path."

    def handle(self, *args, **options):
        try:
            path = wheel.wheel_path()
        except wheel.WheelUnavailable as e:
            raise CommandError(str(e)) from None
        self.stdout.write(str(path))
