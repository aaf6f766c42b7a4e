"""The OpenAPI schema (GET /api/schema) describes every operation: its body, its answers, its errors in the one
error shape, its credentials, and the range of its ids; the docs page (/api/docs) shows it from the site's own
files under the site's Content-Security-Policy. tests/test_api_contract.py holds the live site to the schema."""
from __future__ import annotations

import re

import pytest
from django.core.management import call_command
from django.test import Client

pytestmark = pytest.mark.django_db

ERROR_REF = "#/components/schemas/Error"
MAX_ID = 2**63 - 1


@pytest.fixture(scope="module")
def schema(django_db_blocker) -> dict:
    with django_db_blocker.unblock():
        response = Client().get("/api/schema?format=json")  # as the README says (YAML without it)
    assert response.status_code == 200
    return response.json()


def operations(schema: dict):
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            yield path, method.upper(), operation


def test_the_schema_generates_and_validates_without_a_warning(tmp_path):
    # --fail-on-warn: a view whose body or answer spectacular cannot tell fails here, not only in `check --deploy`
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))

    assert (tmp_path / "schema.yaml").read_text().startswith("openapi: 3")


def test_every_operation_has_a_success_answer_and_its_errors_in_the_one_shape(schema):
    for path, method, operation in operations(schema):
        statuses = set(operation["responses"])
        assert any(s.startswith("2") for s in statuses), (method, path)
        for status, response in operation["responses"].items():
            if status[0] in "45":
                assert response["content"] == {"application/json": {"schema": {"$ref": ERROR_REF}}}, (method, path)
    error = schema["components"]["schemas"]["ErrorBody"]
    assert set(error["required"]) == {"code", "message", "detail"}


def test_every_body_is_declared_as_json_or_as_a_multipart_form(schema):
    multipart = {path for path, method, operation in operations(schema)
                 if "multipart/form-data" in operation.get("requestBody", {}).get("content", {})}

    assert multipart == {"/api/datasets", "/api/worker/units/{unit_id}/result", "/api/jobs/{job_id}/predict",
                         "/api/jobs/{job_id}/predictions",
                         "/api/worker/units/{unit_id}/checkpoints/{boundary}", "/api/worker/checks/{check_id}/result"}
    for path, method, operation in operations(schema):
        if path == "/api/jobs/{job_id}/predict":  # rows as JSON, or a file (CSV, images, .npz) as a form
            assert set(operation["requestBody"]["content"]) == {"application/json", "multipart/form-data"}
        elif "requestBody" in operation:
            assert len(operation["requestBody"]["content"]) == 1, (method, path)
    result = schema["components"]["schemas"]["ResultUploadRequest"]
    assert result["properties"]["weights"] == {"type": "string", "format": "binary",
                                               "description": result["properties"]["weights"]["description"]}
    assert set(result["required"]) == {"weights", "receipt", "signature"}


def test_operations_that_take_no_body_declare_none(schema):
    for path in ("/api/jobs/{job_id}/cancel", "/api/quotes/{quote_id}/accept", "/api/payouts/onboarding",
                 "/api/worker/units/{unit_id}/heartbeat"):
        assert "requestBody" not in schema["paths"][path]["post"], path


def test_downloads_are_binary(schema):
    downloads = {path for path, method, operation in operations(schema)
                 if "application/octet-stream" in operation["responses"].get("200", {}).get("content", {})}

    assert downloads == {"/api/jobs/{job_id}/model", *(f"/api/worker/units/{{unit_id}}/{name}"
                                                       for name in ("weights", "shard", "base")),
                         *(f"/api/worker/checks/{{check_id}}/{name}" for name in ("start", "shard", "base"))}


def test_the_device_operations_take_the_device_token_and_the_others_the_account_token(schema):
    schemes = schema["components"]["securitySchemes"]
    assert schemes["deviceAuth"] == {"type": "apiKey", "in": "header", "name": "Authorization",
                                     "description": schemes["deviceAuth"]["description"]}
    assert "Device <token>" in schemes["deviceAuth"]["description"]
    assert schemes["tokenAuth"]["in"] == "header" and "Token" in schemes["tokenAuth"]["description"]

    for path, method, operation in operations(schema):
        names = {name for requirement in operation.get("security", []) for name in requirement}
        if path.startswith("/api/worker/") and path != "/api/worker/devices":
            assert names == {"deviceAuth"}, (method, path)
        elif path == "/api/worker/devices":
            assert names == {"tokenAuth"}, (method, path)
        elif path == "/api/stripe/webhook":
            assert operation["security"] == [{}]  # Stripe's signature is checked by the view
        else:
            assert "tokenAuth" in names and "deviceAuth" not in names, (method, path)


def test_statuses_that_follow_from_a_view_are_declared(schema):
    paths = schema["paths"]
    # credentials: 401; a role: 403; a throttle: 429 with Retry-After; an id in the path: 404
    assert {"401", "403"} <= set(paths["/api/jobs"]["post"]["responses"])
    assert "401" not in paths["/api/auth/token"]["post"]["responses"]
    for path, method in (("/api/auth/token", "post"), ("/api/auth/signup", "post"), ("/api/worker/claim", "post"),
                         ("/api/worker/devices", "post"), ("/api/worker/units/{unit_id}/heartbeat", "post")):
        throttled = paths[path][method]["responses"]["429"]
        assert throttled["headers"]["Retry-After"]["required"] is True, path
    assert "429" not in paths["/api/jobs"]["post"]["responses"]
    assert "404" in paths["/api/jobs/{job_id}"]["get"]["responses"]
    # what the services answer with, declared per view
    assert {"402", "409", "410"} <= set(paths["/api/jobs/{job_id}/start"]["post"]["responses"])
    assert {"204", "403", "409"} <= set(paths["/api/worker/claim"]["post"]["responses"])
    assert {"413", "409"} <= set(paths["/api/worker/units/{unit_id}/result"]["post"]["responses"])


def test_request_text_says_what_the_api_refuses(schema):
    import re

    components = schema["components"]["schemas"]
    name = components["DeviceRegisterRequest"]["properties"]["name"]["pattern"]
    password = components["TokenRequest"]["properties"]["password"]["pattern"]
    key = components["DeviceRegisterRequest"]["properties"]["public_key"]["pattern"]

    assert [bool(re.search(name, text)) for text in ("laptop", " laptop ", "   ", "lap\x00top")] == [
        True, True, False, False]  # trimmed, it may not be blank; never a NUL
    assert [bool(re.search(password, text)) for text in ("  spaced  ", "   ", "pass\x00word")] == [True, True, False]
    assert re.search(key, "A" * 43 + "=") and not re.search(key, "not-a-key")
    assert components["SignupRequest"]["properties"]["username"]["pattern"] == r"^[\w.@+-]+$"


def test_path_ids_range_over_the_database_ids(schema):
    ids = [parameter for path, method, operation in operations(schema) for parameter in operation.get("parameters", [])
           if parameter["in"] == "path" and parameter["name"] != "quote_id"]

    assert len(ids) > 15
    assert all(p["schema"] == {"type": "integer", "format": "int64", "minimum": 1, "maximum": MAX_ID} for p in ids)


@pytest.mark.parametrize("job_id", [str(MAX_ID + 1), "99999999999999999999", "0"])
def test_an_id_out_of_range_is_a_404_in_the_error_shape(customer_api, job_id):
    response = customer_api.get(f"/api/jobs/{job_id}")

    assert response.status_code == 404
    assert set(response.json()["error"]) == {"code", "message", "detail"}


def test_the_docs_page_loads_only_the_sites_own_files_under_its_policy(settings):
    settings.DEBUG = False
    page = Client().get("/api/docs")
    html = page.content.decode()

    assert page.status_code == 200 and page["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in page["Content-Security-Policy"]
    assert "style-src 'self'" in page["Content-Security-Policy"]
    sources = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sources and all(s.startswith("/") for s in sources), sources  # no CDN
    assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>|<style\b|\sstyle=", html)  # nothing inline
    script = Client().get("/api/docs?script=")
    assert script.status_code == 200 and script["Content-Type"] == "application/javascript"
    assert "/api/schema" in script.content.decode()
    for source in sources:
        if source.startswith("/static/"):
            assert Client().get(source).status_code == 200, source


@pytest.mark.parametrize("accept", ["application/octet-stream", "application/octet-stream, application/json", "*/*"])
def test_a_download_asked_for_as_octet_stream_is_the_file_and_its_errors_json(customer_api, digits_dataset, accept):
    from jobs.models import Job

    job = customer_api.post("/api/jobs", {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 1},
                            format="json").json()
    not_ready = customer_api.get(f"/api/jobs/{job['id']}/model", HTTP_ACCEPT=accept)
    Job.objects.filter(pk=job["id"]).update(status=Job.Status.SUCCEEDED)  # its initial weights as the model
    model = customer_api.get(f"/api/jobs/{job['id']}/model", HTTP_ACCEPT=accept)

    assert not_ready.status_code == 409 and not_ready["Content-Type"] == "application/json"
    assert not_ready.json()["error"]["code"] == "not_ready"
    assert model.status_code == 200 and model["Content-Type"] == "application/octet-stream"
