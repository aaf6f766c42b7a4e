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
        # What nearly every request sends (the worker client's, a browser's fetch): no Accept, or */*, and no
        # ?format=. DRF's answer to that is always the first renderer; parsing the header to find so cost the
        # worker API ~5 % of its CPU (bench/load.py under py-spy).
        if (format_suffix is None and request.META.get("HTTP_ACCEPT", "*/*") == "*/*"
                and self.settings.URL_FORMAT_OVERRIDE not in request.query_params):
            return renderers[0], renderers[0].media_type
        try:
            return super().select_renderer(request, renderers, format_suffix)
        except NotAcceptable:
            return renderers[0], renderers[0].media_type

    def filter_renderers(self, renderers, format):
        """`?format=` names a renderer (the schema's `?format=json`) or, where none has that name, the view's own
        choice of file (a model's `?format=onnx`, predictions' `?format=csv`): then the view's renderers stand."""
        return [r for r in renderers if r.format == format] or renderers
