"""Content negotiation that never answers 406: where no renderer matches the request's Accept, the answer is JSON.

A download (weights, shards, the trained model) is declared `application/octet-stream` and its errors
`application/json`; a client that asks only for `Accept: application/octet-stream` (as some generated clients do)
got DRF's 406 before the view ran, for the file and for its errors alike. RFC 9110 (12.5.1) lets a server
disregard Accept: the file comes as it is and an error in the one JSON error shape.
"""
from rest_framework.exceptions import NotAcceptable
from rest_framework.negotiation import DefaultContentNegotiation


class JsonFallbackNegotiation(DefaultContentNegotiation):
    def select_renderer(self, request, renderers, format_suffix=None):
        try:
            return super().select_renderer(request, renderers, format_suffix)
        except NotAcceptable:
            return renderers[0], renderers[0].media_type


class _NoFormatOverride:
    URL_FORMAT_OVERRIDE = None


class FileFormatNegotiation(JsonFallbackNegotiation):
    """For a download whose own `format` query parameter names the file's format (the model's `?format=onnx`): DRF
    reads `?format=` as a renderer's name and answers one it has no renderer for with a 404 before the view runs."""

    settings = _NoFormatOverride()
