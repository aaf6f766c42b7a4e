"""Request-wide guards: bodies over their endpoint's limit are refused before they are read; every page carries
the site's Content-Security-Policy."""
from __future__ import annotations

import re

from django.conf import settings
from django.http import HttpResponse, JsonResponse

from .errors import error_body

FORM_SLACK = 1024 * 1024  # multipart headers and the form's small fields (a receipt) beside the file

# (path pattern, the file limit's setting, multiple): the endpoints that take files; every other request may
# carry DATA_UPLOAD_MAX_MEMORY_SIZE.
_UPLOADS = [
    # a result: the update, and the last checkpoint that may come with it (as a checkpoint's upload allows)
    (re.compile(r"^/api/worker/units/\d+/result$"), "MUNINN_MAX_RESULT_BYTES", 3),
    (re.compile(r"^/api/worker/units/\d+/checkpoints/\d+$"), "MUNINN_MAX_RESULT_BYTES", 2),
    (re.compile(r"^/api/worker/checks/\d+/result$"), "MUNINN_MAX_RESULT_BYTES", 2),
    (re.compile(r"^/(api/datasets|datasets/)$"), "MUNINN_MAX_UPLOAD_BYTES", 1),
]


def body_limit(path: str) -> tuple[int, int]:
    """The most a request to `path` may send, and the file limit it answers with (0: not a file upload)."""
    for pattern, setting, multiple in _UPLOADS:
        if pattern.match(path):
            files = multiple * getattr(settings, setting)
            return files + FORM_SLACK, files
    return settings.DATA_UPLOAD_MAX_MEMORY_SIZE + FORM_SLACK, 0


class BodyLimitMiddleware:
    """Refuse a body from its Content-Length, before a byte of it is read. Django's WSGI request never reads
    past the Content-Length it was given (LimitedStream), and reads nothing without one, so a lying or missing
    header cannot make it take in more than this middleware judged."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        try:
            declared = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return _refuse(request, 400, "invalid", "The Content-Length header is not a number.", {})
        limit, files = body_limit(request.path)
        if declared > limit:
            message = (f"The file is about {declared:,} bytes; the limit is {files:,}." if files else
                       f"The request body is {declared:,} bytes; the limit is {limit:,}.")
            return _refuse(request, 413, "too_large", message, {"content_length": declared, "limit": files or limit})
        return self.get_response(request)


def _refuse(request, status: int, code: str, message: str, detail: dict) -> HttpResponse:
    # The client may still be sending: ask it to close rather than read what is left.
    if request.path.startswith("/api/"):
        response = JsonResponse(error_body(code, message, detail), status=status)
    else:
        response = HttpResponse(message, status=status, content_type="text/plain; charset=utf-8")
    response["Connection"] = "close"
    return response


class ContentSecurityPolicyMiddleware:
    """Send settings.MUNINN_CONTENT_SECURITY_POLICY with every HTML response (Django 5.2 has no CSP of its own;
    6.0's django.middleware.csp can replace this). The pages load scripts and styles from static/ only and keep
    no inline ones (tests/test_request_limits.py), so an injected <script> or handler runs nowhere."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        response = self.get_response(request)
        if not response.get("Content-Type", "").startswith("text/html"):
            return response
        if settings.DEBUG and response.status_code in (404, 500):
            return response  # Django's debug pages (DEBUG only) style and script themselves inline
        response.headers.setdefault("Content-Security-Policy", settings.MUNINN_CONTENT_SECURITY_POLICY)
        return response
