"""Request bodies are read as the OpenAPI schema describes them (what tests/test_api_contract.py's run of
schemathesis found, pinned here as fast tests): a JSON body's values have their field's JSON type, a body that is
not a JSON object is a 400, and what the models refuse is a 400 from the API, never a 500."""
from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from accounts import services as accounts
from accounts.models import User
from muninn_worker import signing
from jobs.models import Job

pytestmark = pytest.mark.django_db

SIGNUP = {"username": "newcomer", "password": "long-enough-123", "role": "customer"}


def error_of(response) -> dict:
    assert set(response.json()["error"]) == {"code", "message", "detail"}, response.content
    return response.json()["error"]


@pytest.mark.parametrize("change", [{"username": "two words"}, {"username": "tab\there"},
                                    {"email": "a" * 250 + "@example.com"}])
def test_a_sign_up_the_account_model_refuses_is_a_400_naming_the_field(change):
    response = APIClient().post("/api/auth/signup", {**SIGNUP, **change}, format="json")

    assert response.status_code == 400
    assert set(error_of(response)["detail"]) == set(change)
    assert not User.objects.exists()


def test_a_password_is_taken_as_typed_not_trimmed():
    APIClient().post("/api/auth/signup", {**SIGNUP, "password": "  spaced out  "}, format="json")

    as_typed = APIClient().post("/api/auth/token", {"username": "newcomer", "password": "  spaced out  "}, format="json")
    trimmed = APIClient().post("/api/auth/token", {"username": "newcomer", "password": "spaced out"}, format="json")

    assert as_typed.status_code == 200 and trimmed.status_code == 400


def test_a_username_already_taken_is_a_409(customer):
    response = APIClient().post("/api/auth/signup", {**SIGNUP, "username": customer.username}, format="json")

    assert response.status_code == 409 and error_of(response)["code"] == "username_taken"


@pytest.mark.parametrize("path, body", [
    ("/api/auth/signup", {**SIGNUP, "username": 7}),  # a number where the schema says string
    ("/api/auth/token", {"username": "alice", "password": 12345678}),
])
def test_a_json_value_of_another_type_than_the_schemas_is_a_400(customer, path, body):
    response = APIClient().post(path, body, format="json")

    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "invalid" and "Must be a string." in error["message"]


def test_json_numbers_and_booleans_must_be_numbers_and_booleans_but_a_form_posts_strings(customer_api,
                                                                                         digits_dataset):
    job = {"dataset": digits_dataset["id"], "template": "mlp"}

    as_string = customer_api.post("/api/estimates", {**job, "rounds": "2"}, format="json")
    as_number = customer_api.post("/api/estimates", {**job, "rounds": 2}, format="json")
    as_form = customer_api.post("/api/estimates", {**job, "rounds": "2"}, format="multipart")
    start = customer_api.post("/api/jobs", {**job, "rounds": 2, "start": "yes"}, format="json")

    assert as_string.status_code == 400 and error_of(as_string)["detail"] == {"rounds": ["Must be an integer."]}
    assert as_number.status_code == 200 and as_form.status_code == 200
    assert start.status_code == 400 and error_of(start)["detail"] == {"start": ["Must be a boolean."]}


@pytest.mark.parametrize("path", ["/api/auth/token", "/api/auth/signup", "/api/estimates", "/api/worker/claim"])
def test_a_json_body_that_is_not_an_object_is_a_400(customer_api, make_device, path):
    client = make_device().client if path == "/api/worker/claim" else customer_api

    response = client.post(path, [None, None], format="json")

    assert response.status_code == 400 and error_of(response)["code"] == "invalid"


@pytest.mark.parametrize("body, query", [({"wait": 0}, "?wait=-1"), ({"wait": "5"}, "")])
def test_a_claims_wait_is_checked_in_the_query_beside_a_body_and_must_be_a_json_number(make_device, body, query):
    response = make_device().client.post(f"/api/worker/claim{query}", body, format="json")

    assert response.status_code == 400 and error_of(response)["code"] == "bad_wait"


def test_a_dataset_id_past_a_bigint_is_a_400_and_one_that_names_nothing_a_404(customer_api):
    huge = customer_api.post("/api/jobs", {"dataset": 2**63, "template": "mlp", "rounds": 1}, format="json")
    missing = customer_api.post("/api/jobs", {"dataset": 2**63 - 1, "template": "mlp", "rounds": 1}, format="json")

    assert huge.status_code == 400 and "dataset" in error_of(huge)["detail"]
    assert missing.status_code == 404


def test_the_merged_model_of_a_job_that_is_not_lora_is_not_found(customer_api, digits_dataset):
    job = customer_api.post("/api/jobs", {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 1},
                            format="json").json()
    Job.objects.filter(pk=job["id"]).update(status=Job.Status.SUCCEEDED)  # its initial weights as the model

    response = customer_api.get(f"/api/jobs/{job['id']}/model?artefact=merged")

    assert response.status_code == 404


@pytest.mark.parametrize("change", [{"ram_bytes": 2**63}, {"gpus": [{"name": "big", "memory_bytes": 2**63}]}])
def test_a_device_with_more_memory_than_a_bigint_is_a_400(contributor, change):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {accounts.token_for(user=contributor)}")
    capabilities = {"cpu_cores": 2, "ram_bytes": 2**33, "backends": ["cpu"], "torch_version": "2.13.0", **change}

    response = client.post("/api/worker/devices", {"name": "laptop", "capabilities": capabilities,
                                                   "public_key": signing.public_key_of(signing.new_private_key())},
                           format="json")

    assert response.status_code == 400 and "capabilities" in error_of(response)["detail"]
