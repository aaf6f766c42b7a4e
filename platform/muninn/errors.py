"""One error shape for the whole API: {"error": {"code", "message", "detail"}}.

Services raise `MuninnError` subclasses (domain words, no HTTP); the handler below turns them and DRF's own
exceptions into that shape with a fitting status.
"""
from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied
from django.core.exceptions import ValidationError as ModelValidationError
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.serializers import as_serializer_error
from rest_framework.views import exception_handler


log = logging.getLogger(__name__)


class MuninnError(Exception):
    """A refusal a caller can act on. `status` is the HTTP status the API answers with."""

    code = "error"
    status = status.HTTP_400_BAD_REQUEST

    def __init__(self, message: str, *, code: str | None = None, detail: dict[str, Any] | None = None,
                 status_code: int | None = None):
        super().__init__(message)
        self.message = message
        if code:
            self.code = code
        if status_code:
            self.status = status_code
        self.detail = detail or {}


class InvalidInput(MuninnError):
    code = "invalid"
    status = status.HTTP_400_BAD_REQUEST


class NotFound(MuninnError):
    code = "not_found"
    status = status.HTTP_404_NOT_FOUND


class Conflict(MuninnError):
    code = "conflict"
    status = status.HTTP_409_CONFLICT


class TooLarge(MuninnError):
    code = "too_large"
    status = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE


def error_body(code: str, message: str, detail: Any = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "detail": detail or {}}}


def _first_message(detail: Any) -> str:
    if isinstance(detail, dict):
        for key, value in detail.items():
            inner = _first_message(value)
            return inner if key == "non_field_errors" else f"{key}: {inner}"
    if isinstance(detail, list) and detail:
        return _first_message(detail[0])
    return str(detail)


def api_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, MuninnError):
        if exc.status >= 500:  # the site's own fault (e.g. sealing.SealError): the operator must hear of it
            log.error("%s: %s %s", exc.code, context["request"].path if context.get("request") else "", exc.message)
        return Response(error_body(exc.code, exc.message, exc.detail), status=exc.status)
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, PermissionDenied):
        exc = exceptions.PermissionDenied()
    elif isinstance(exc, ModelValidationError):  # a model's full_clean() in a service: the input, not the site
        exc = exceptions.ValidationError(as_serializer_error(exc))
    response = exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        code, message = "invalid", _first_message(exc.detail)
    else:
        code = getattr(exc, "default_code", "error")
        message = _first_message(exc.detail) if hasattr(exc, "detail") else str(exc)
    detail = exc.detail if isinstance(exc, exceptions.ValidationError) else {}
    response.data = error_body(code, message, detail)
    return response
