"""Which worker clients the site still speaks to. The reference client names its version in every request
(`User-Agent: muninn-worker/<version>`; another client may send `Muninn-Client-Version: <version>`). One older
than MUNINN_MIN_WORKER_VERSION gets 426 `client_too_old` with the command that upgrades it, on every worker
endpoint, before anything else: it would otherwise fail on a field it does not know. A client that names no
version is taken at its word that it follows docs/worker-protocol.md as it is."""
from __future__ import annotations

import re

from django.conf import settings
from django.http import JsonResponse

from muninn.errors import error_body

from . import install

_AGENT = re.compile(r"\bmuninn-worker/(\d+(?:\.\d+)*)")


def parse(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def client_version(meta: dict) -> str | None:
    """The version a request's client names, or None."""
    explicit = meta.get("HTTP_MUNINN_CLIENT_VERSION", "").strip()
    if re.fullmatch(r"\d+(?:\.\d+)*", explicit):
        return explicit
    found = _AGENT.search(meta.get("HTTP_USER_AGENT", ""))
    return found.group(1) if found else None


def too_old(version: str | None) -> bool:
    return version is not None and parse(version) < parse(settings.MUNINN_MIN_WORKER_VERSION)


class WorkerVersionMiddleware:
    """426 for a worker client older than the site supports (only under /api/worker/)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path.startswith("/api/worker/"):
            version = client_version(request.META)
            if too_old(version):
                minimum = settings.MUNINN_MIN_WORKER_VERSION
                upgrade = install.upgrade(request.build_absolute_uri("/"))
                return JsonResponse(error_body(
                    "client_too_old", f"This site needs muninn-worker {minimum} or newer; this is {version}. "
                                      f"Upgrade it with `{upgrade}`, then start it again.",
                    {"minimum": minimum, "version": version, "upgrade": upgrade}), status=426)
        return self.get_response(request)
