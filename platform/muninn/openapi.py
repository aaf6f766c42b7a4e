"""The API's OpenAPI schema (drf-spectacular, GET /api/schema): what every view shares.

- `ErrorSerializer`: the one error shape (muninn/errors.py), and `errors(...)` to declare the statuses a view's
  services answer with (400 InvalidInput, 404 NotFound, 409 Conflict, 413 TooLarge, 402, 410, ...).
- `AutoSchema` adds what follows from a view's own settings, so it cannot drift from them: 401 where it needs
  credentials, 403 where a permission checks the account's role (or CSRF may refuse a session's write), 429 with
  Retry-After where a throttle counts the method, 404 where the path names an object, and 400/413/415 where a
  body is read.
- `DeviceTokenScheme`: the worker's `Authorization: Device <token>` (contributors/authentication.py).
- `binary(...)`: a 200 that is a file (weights, shards, checkpoints, the trained model).
- Bodies are documented as JSON, or as multipart where a view takes files (see `AutoSchema.map_parsers`), their
  text fields with what DRF's CharField refuses (a NUL character; only whitespace where it may not be blank).

Path ids are integers from 1 to 2**63 - 1 (the `id` converter: settings.SPECTACULAR_SETTINGS).
"""
from __future__ import annotations

from drf_spectacular import openapi
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.plumbing import force_instance
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema_field
from rest_framework import permissions, serializers
from rest_framework.authentication import SessionAuthentication


@extend_schema_field({"oneOf": [{"type": "object", "additionalProperties": {}}, {"type": "array", "items": {}}]})
class _DetailField(serializers.JSONField):
    pass


class ErrorBodySerializer(serializers.Serializer):
    code = serializers.CharField(help_text="A stable slug to act on: `invalid`, `not_found`, `lease_lost`, ...")
    message = serializers.CharField(help_text="A sentence for people.")
    detail = _DetailField(help_text="More about it: for `invalid`, the errors per field; often empty.")


class ErrorSerializer(serializers.Serializer):
    """Every error the API answers with (muninn/errors.py)."""

    error = ErrorBodySerializer()


WHY = {
    400: "Invalid input: the body, a parameter, or a check the request failed (`code` says which).",
    401: "No credentials, or unknown ones.",
    402: "Not enough money: `insufficient_balance` (the customer's balance) or `above_available` (earnings).",
    403: "Not allowed for this account or device.",
    404: "No such object (or not yours).",
    409: "Conflicts with the object's state.",
    410: "Gone: the quote has expired (`quote_expired`).",
    413: "The body is too large (`too_large`), refused from its Content-Length before it is read.",
    415: "A body in a media type this operation does not take.",
    429: "Throttled (`throttled`): wait `Retry-After` seconds, then send the same request again.",
    502: "Stripe refused or failed the request (`payment_provider_error`).",
    503: "Payments are not configured on this site (`payments_disabled`).",
}


def errors(*statuses: int, codes: dict[int, str] | None = None) -> dict[int, OpenApiResponse]:
    """Error responses for `extend_schema(responses={...})`, in the one error shape. `codes` names, per status,
    the error codes the view's services send with it (a status named there is declared too)."""
    codes = codes or {}
    return {status: OpenApiResponse(ErrorSerializer, description=WHY[status] + (
        f" Codes: {codes[status]}." if status in codes else "")) for status in sorted({*statuses, *codes})}


RETRY_AFTER = {"schema": {"type": "integer", "minimum": 0}, "description": "Seconds to wait before trying again."}

OCTET_STREAM = "application/octet-stream"


def binary(description: str) -> dict:
    """A 200 that is a file: `responses={**binary("..."), **errors(...)}`."""
    return {(200, OCTET_STREAM): OpenApiResponse(OpenApiTypes.BINARY, description=description)}


def retry_after_header(*statuses: int, required: bool = True) -> OpenApiParameter:
    """A Retry-After response header on `statuses` (for `extend_schema(parameters=[...])`)."""
    return OpenApiParameter("Retry-After", int, OpenApiParameter.HEADER, response=list(statuses), required=required,
                            description=RETRY_AFTER["description"])


# Permissions that refuse only callers without credentials, which DRF answers 401 (never 403): a device view's
# HasDevice fails only when no device token authenticated the request.
_ONLY_401 = {"rest_framework.permissions.AllowAny", "rest_framework.permissions.IsAuthenticated",
             "contributors.authentication.HasDevice"}
_UNSAFE = ("POST", "PUT", "PATCH", "DELETE")

# What DRF's CharField takes, as a pattern: never a NUL character (it refuses them; PostgreSQL cannot store them),
# and where it trims whitespace and may not be blank, at least one character that is not whitespace.
TEXT = "^[^\\u0000]*$"
TEXT_NOT_BLANK = "^[^\\u0000]*[^\\s\\u0000][^\\u0000]*$"


class AutoSchema(openapi.AutoSchema):
    """drf-spectacular's, with the error responses that follow from the view's settings added to each operation's
    declared ones (see the module's docstring)."""

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        error = {"application/json": {"schema": self.resolve_serializer(ErrorSerializer, direction).ref}}
        for status in self._implied_errors():
            response = responses.setdefault(str(status), {"content": error, "description": WHY[status]})
            if status == 429:
                response.setdefault("headers", {})["Retry-After"] = {**RETRY_AFTER, "required": True}
        return dict(sorted(responses.items()))

    def _implied_errors(self) -> list[int]:
        view, statuses = self.view, []
        perms = [type(p) for p in view.get_permissions()]
        authenticators = view.get_authenticators()
        if authenticators and permissions.AllowAny not in perms:
            statuses.append(401)
        csrf = self.method in _UNSAFE and any(isinstance(a, SessionAuthentication) for a in authenticators)
        if csrf or any(f"{p.__module__}.{p.__qualname__}" not in _ONLY_401 for p in perms):
            statuses.append(403)
        if self._takes_body():
            statuses += [400, 413, 415]
        if "{" in self.path:
            statuses.append(404)
        if any(self.method in getattr(t, "methods", ()) for t in view.get_throttles()):
            statuses.append(429)
        return statuses

    def _map_basic_serializer(self, serializer, direction):
        schema = super()._map_basic_serializer(serializer, direction)
        if direction == "request":  # after the field's own validators had their say (a RegexField's pattern)
            for name, field in force_instance(serializer).fields.items():
                prop = schema["properties"].get(name, {})
                if (isinstance(field, serializers.CharField) and prop.get("type") == "string"
                        and not {"pattern", "format", "enum"} & set(prop)):
                    prop["pattern"] = TEXT if field.allow_blank or not field.trim_whitespace else TEXT_NOT_BLANK
        return schema

    def map_parsers(self):
        # Bodies are documented as JSON: the views parse form posts too (DRF's default parsers), but a form cannot
        # carry the nested objects most of them take. Views that take files name their multipart parsers.
        media_types = super().map_parsers()
        return ["application/json"] if "application/json" in media_types else media_types

    def _takes_body(self) -> bool:
        return self.method in _UNSAFE and self.get_request_serializer() is not None


class DeviceTokenScheme(OpenApiAuthenticationExtension):
    """`Authorization: Device <token>`, the token POST /api/worker/devices returns (docs/worker-protocol.md)."""

    target_class = "contributors.authentication.DeviceTokenAuthentication"
    name = "deviceAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "header", "name": "Authorization",
                "description": "A device's token with the prefix \"Device\": `Authorization: Device <token>`. "
                               "Register a device (POST /api/worker/devices, with the account token) to get one."}
