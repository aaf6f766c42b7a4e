"""Oversized bodies are refused from their Content-Length before a byte is read; the pages keep no inline
scripts or handlers (ready for a Content-Security-Policy)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


class UnreadableBody:
    """A request body that fails the test if anything reads it."""

    def read(self, *args):
        raise AssertionError("the body was read")

    readline = read


def post_declaring(path: str, length: int):
    return Client().generic("POST", path, b"", content_type="multipart/form-data; boundary=x",
                            CONTENT_LENGTH=str(length), **{"wsgi.input": UnreadableBody()})


@pytest.mark.parametrize("path, setting", [
    ("/api/worker/units/1/result", "MUNINN_MAX_RESULT_BYTES"),
    ("/api/worker/units/1/checkpoints/2", "MUNINN_MAX_RESULT_BYTES"),
    ("/api/datasets", "MUNINN_MAX_UPLOAD_BYTES"),
])
def test_an_oversized_upload_is_refused_without_being_read(settings, path, setting):
    setattr(settings, setting, 1000)

    response = post_declaring(path, 200 * 2**20)

    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "too_large" and "the limit is" in error["message"]
    assert error["detail"]["content_length"] == 200 * 2**20 and error["detail"]["limit"] >= 1000


def test_a_large_body_to_an_endpoint_that_takes_no_file_is_refused_without_being_read(settings):
    response = post_declaring("/api/worker/claim", settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 2 * 2**20)

    assert response.status_code == 413 and response.json()["error"]["code"] == "too_large"


def test_a_dataset_page_upload_over_the_limit_is_refused_without_being_read(settings):
    settings.MUNINN_MAX_UPLOAD_BYTES = 1000

    response = post_declaring("/datasets/", 200 * 2**20)

    assert response.status_code == 413 and b"the limit is 1,000" in response.content


def test_a_content_length_that_is_not_a_number_is_a_400():
    response = Client().generic("POST", "/api/worker/claim", b"", CONTENT_LENGTH="lots",
                                **{"wsgi.input": UnreadableBody()})

    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid"


def test_templates_have_no_inline_scripts_or_event_handlers():
    offending = []
    for template in TEMPLATES.rglob("*.html"):
        text = template.read_text()
        offending += [f"{template.name}: {m.group(0)}" for m in re.finditer(r"<script(?![^>]*\bsrc=)[^>]*>", text)]
        offending += [f"{template.name}: {m.group(0)}" for m in re.finditer(r"\son[a-z]+\s*=", text)]
    assert offending == []


def test_an_api_url_that_names_no_endpoint_is_a_json_404_and_a_page_url_the_sites_page(client, settings):
    settings.DEBUG = False

    api = client.get("/api/no-such-endpoint")
    huge = client.get("/api/jobs/99999999999999999999999")  # an id no column holds: no such job
    page = client.get("/no-such-page/")

    for response in (api, huge):
        assert response.status_code == 404 and response["Content-Type"] == "application/json"
        assert response.json()["error"]["code"] == "not_found"
    assert "/api/schema" in api.json()["error"]["message"]
    assert page.status_code == 404 and page["Content-Type"].startswith("text/html")
