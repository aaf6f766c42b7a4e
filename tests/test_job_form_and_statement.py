"""The new-job page offers the training algorithm and update encoding the API takes (defaults FedAvg and fp32,
refusals naming the field, the job created with the choice), and the statement comes in pages."""
from __future__ import annotations

import pytest
from django.test import Client

from billing import money
from billing import services as billing
from jobs.models import Dataset, Job

from .conftest import digits_npz, named_file

pytestmark = pytest.mark.django_db


@pytest.fixture
def client(customer) -> Client:
    client = Client()
    client.force_login(customer)
    return client


@pytest.fixture
def digits(client) -> Dataset:
    assert client.post("/datasets/", {"file": named_file(digits_npz(300), "digits.npz")}).status_code == 302
    return Dataset.objects.get()


def job_form(dataset: Dataset, **fields) -> dict:
    return {"dataset": dataset.pk, "template": "mlp", "rounds": 2, "aggregation": "fedavg", **fields}


def test_the_new_job_page_offers_algorithm_and_encoding_with_their_defaults(client, digits):
    page = client.get("/jobs/new/").content.decode()

    assert '<select name="algorithm" id="id_algorithm">' in page
    assert '<option value="fedavg" selected>' in page and '<option value="diloco">' in page
    assert '<select name="update_encoding" id="id_update_encoding">' in page
    assert '<option value="fp32" selected>' in page and '<option value="int8">' in page
    assert 'id="diloco-settings" class="plain" hidden disabled' in page
    assert 'name="inner_steps" id="id_inner_steps" value="20"' in page  # DiLoCo's default, shown when chosen


def test_a_diloco_int8_choice_on_the_page_is_quoted_and_starts_that_job(client, digits):
    quoted = client.post("/jobs/new/", {**job_form(digits, algorithm="diloco", inner_steps="5", outer_lr="0.5",
                                                   outer_momentum="0.8", update_encoding="int8"), "action": "quote"})
    assert quoted.status_code == 200
    quote_id = quoted.context["quote"]["id"]

    started = client.post("/jobs/new/", {**job_form(digits), "quote": quote_id, "action": "accept"})

    assert started.status_code == 302
    job = Job.objects.get()
    assert (job.algorithm, job.inner_steps, job.outer_lr, job.outer_momentum, job.update_encoding) == (
        "diloco", 5, 0.5, 0.8, "int8")


def test_fedavg_ignores_the_hidden_diloco_settings_and_defaults_to_fp32(client, digits):
    quoted = client.post("/jobs/new/", {**job_form(digits), "action": "quote"})

    assert quoted.status_code == 200
    started = client.post("/jobs/new/", {**job_form(digits), "quote": quoted.context["quote"]["id"],
                                         "action": "accept"})
    assert started.status_code == 302
    job = Job.objects.get()
    assert (job.algorithm, job.inner_steps, job.update_encoding) == ("fedavg", None, "fp32")


@pytest.mark.parametrize("fields, named", [
    ({"algorithm": "diloco", "inner_steps": "0"}, "inner_steps"),
    ({"algorithm": "diloco", "inner_steps": "2.5"}, "inner_steps"),
    ({"algorithm": "diloco", "outer_momentum": "1"}, "outer_momentum"),
    ({"algorithm": "diloco", "outer_lr": "fast"}, "outer_lr"),
    ({"algorithm": "adam"}, "algorithm"),
    ({"update_encoding": "int4"}, "update_encoding"),
])
def test_bad_algorithm_settings_are_refused_on_the_page_naming_the_field(client, digits, fields, named):
    response = client.post("/jobs/new/", {**job_form(digits, **fields), "action": "quote"})

    page = response.content.decode()
    assert response.status_code == 400
    assert named in page and f"field: {named}" in page
    assert response.context["quote"] is None and not Job.objects.exists()


def test_the_statement_comes_in_pages_of_fifty_newest_first(client, customer, staff):
    for i in range(1, 61):  # with the fixture's grant: 61 entries
        billing.balance_grant(user=customer, amount=money.to_nanos("1") + i, reason=f"credit {i}", granted_by=staff)

    first = client.get("/balance/").content.decode()
    second = client.get("/balance/?page=2").content.decode()

    assert first.count("Manual credit</td>") == 50 and second.count("Manual credit</td>") == 11
    assert "credit 60" in first and "credit 10" not in first and "credit 10<" in second and "test credit" in second
    assert "page 1 of 2" in first and 'href="?page=2"' in first and "entries 51–61 of 61" in second
    assert client.get("/balance/?page=3").status_code == 404
    assert client.get("/balance/?page=x").status_code == 404
