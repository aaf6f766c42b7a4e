"""URL path converters. `<id:...>` is a database id: Django's `<int:...>` matches any run of digits, and an id
past a bigint reached the database as an OverflowError (a 500 on SQLite); this one matches nothing, a 404."""
from django.urls import register_converter

MAX_ID = 2**63 - 1  # a BigAutoField's largest value


class IdConverter:
    regex = "[0-9]{1,19}"

    def to_python(self, value: str) -> int:
        number = int(value)
        if number > MAX_ID:
            raise ValueError("not an id")  # a ValueError here means "this pattern does not match"
        return number

    def to_url(self, value: int) -> str:
        return str(value)


register_converter(IdConverter, "id")
