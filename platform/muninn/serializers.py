"""Request serializers that hold a JSON body to the types its OpenAPI schema states.

DRF reads "5" as the integer 5, 5 as the string "5" and "yes" as true: a form needs that (every value it posts is
a string), a JSON body does not, and a client built from the schema must be able to rely on what it says. So a
JSON body's values must have their field's JSON type (a 400 naming the field otherwise); form and multipart
bodies (QueryDicts) are read as DRF reads them.
"""
from __future__ import annotations

from collections.abc import Mapping

from django.http import QueryDict
from rest_framework import serializers

_STRING = (serializers.CharField, serializers.ChoiceField, serializers.DecimalField, serializers.UUIDField,
           serializers.DateTimeField, serializers.DateField, serializers.TimeField, serializers.DurationField)


def _json_type(field: serializers.Field) -> tuple[type, ...] | None:
    """The Python types a JSON value for `field` may have, or None where any will do."""
    if isinstance(field, serializers.BooleanField):
        return (bool,)
    if isinstance(field, serializers.IntegerField):
        return (int,)
    if isinstance(field, serializers.FloatField):
        return (int, float)
    if isinstance(field, serializers.ChoiceField) and not all(isinstance(c, str) for c in field.choices):
        return None
    if isinstance(field, _STRING):
        return (str,)
    if isinstance(field, (serializers.ListField, serializers.ListSerializer)):
        return (list,)
    if isinstance(field, (serializers.DictField, serializers.Serializer)):
        return (dict,)
    return None


_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
          dict: "an object"}


class StrictSerializer(serializers.Serializer):
    def to_internal_value(self, data):
        if isinstance(data, Mapping) and not isinstance(data, QueryDict):
            errors = {}
            for name, field in self.fields.items():
                if field.read_only or field.source == "*" or name not in data or data[name] is None:
                    continue  # DRF says what is wrong with a null
                types = _json_type(field)
                value = data[name]
                if types == (int,) and isinstance(value, float) and value.is_integer():
                    continue  # JSON Schema's "integer" is any number without a fraction: 3.0 is one
                if types and (not isinstance(value, types) or (bool not in types and isinstance(value, bool))):
                    errors[name] = [f"Must be {_NAMES[types[-1]]}."]
            if errors:
                raise serializers.ValidationError(errors)
        return super().to_internal_value(data)
