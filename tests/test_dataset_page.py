"""The dataset page's profile: the missing-values notice names each column, how many rows, which (the first few)
and what they were filled with."""
from __future__ import annotations

import pytest
from django.test import Client

from jobs.models import Dataset

from .conftest import named_file

pytestmark = pytest.mark.django_db

ROWS = ["size,colour,label"] + [
    f"{'' if i in (2, 4, 6, 8, 10, 12, 14) else i / 2},{'' if i == 3 else ('red' if i % 2 else 'blue')},{i % 2}"
    for i in range(1, 41)]


def test_the_missing_values_notice_shows_column_count_rows_and_fill(customer):
    client = Client()
    client.force_login(customer)
    assert client.post("/datasets/", {"file": named_file("\n".join(ROWS).encode(), "wine.csv")}).status_code == 302
    dataset = Dataset.objects.get()

    page = client.get(f"/datasets/{dataset.pk}/").content.decode()

    median = dataset.profile["missing"]["size"]["filled_with"]
    assert (f"<code>size</code>: 7 rows (3, 5, 7, 9, 11 and 2 more), filled with the median <code>{median:g}</code>"
            in page)
    assert "<code>colour</code>: 1 row (4), filled with the category <code>(missing)</code>" in page
    assert "filled_with" not in page and "rows count" not in page
