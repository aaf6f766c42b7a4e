"""The front page is public: it shows totals that name no one, and a signed-in customer sees only their own
jobs there and on their pages. Two customers with real jobs, worked by a simulated device, and the pages read
through Django's test client: every name that must not leak is first seen on its owner's page."""
from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
from django.test import Client
from rest_framework.test import APIClient

from accounts import services as accounts
from accounts.models import User
from billing import money
from billing import services as billing
from jobs.hu import flops_to_hu, hu_str
from jobs.models import Dataset, Job, WorkUnit
from muninn import figures

from .conftest import digits_npz, named_file
from .test_spine import run_until_done

pytestmark = pytest.mark.django_db(transaction=True)  # jobs start and rounds close on commit


@dataclass
class Customer:
    user: User
    dataset: Dataset
    job: Job

    @property
    def client(self) -> Client:
        client = Client()
        client.force_login(self.user)
        return client

    def traces(self) -> list[str]:
        """What on a page would name this customer, their dataset or their job."""
        return [self.user.username, self.dataset.name, f"/jobs/{self.job.pk}/", f"Job {self.job.pk}",
                f"/datasets/{self.dataset.pk}/"]


def found(html: str, traces: list[str]) -> list[str]:
    return [t for t in traces if re.search(rf"(?<![\w/-]){re.escape(t)}(?![\w-])", html)]


def customer_with_a_job(api: APIClient, user: User, dataset_name: str) -> Customer:
    upload = api.post("/api/datasets", {"file": named_file(digits_npz(200), "digits.npz"), "name": dataset_name},
                      format="multipart")
    assert upload.status_code == 201, upload.content
    job = api.post("/api/jobs", {"dataset": upload.json()["id"], "template": "mlp", "rounds": 1, "start": True},
                   format="json")
    assert job.status_code == 201, job.content
    return Customer(user=user, dataset=Dataset.objects.get(pk=upload.json()["id"]),
                    job=Job.objects.get(pk=job.json()["id"]))


@pytest.fixture
def two_customers(customer, customer_api, staff, make_device) -> tuple[Customer, Customer]:
    """alice and zebulon, each with a dataset and a one-round job that a device has trained to the end."""
    zebulon = accounts.user_create(username="zebulon", password="zebulon-pass-123", role=User.Role.CUSTOMER)
    billing.balance_grant(user=zebulon, amount=money.to_nanos("10"), reason="test credit", granted_by=staff)
    zebulon_api = APIClient()
    zebulon_api.credentials(HTTP_AUTHORIZATION=f"Token {accounts.token_for(user=zebulon)}")
    device = make_device("rig-quasar")  # online before the jobs start, so their rounds are planned for it
    a = customer_with_a_job(customer_api, customer, "alice-heart-study")
    b = customer_with_a_job(zebulon_api, zebulon, "zebulon-tumour-scans")
    for c in (a, b):
        c.job = run_until_done([device], c.job.pk)
        assert c.job.status == Job.Status.SUCCEEDED, (c.job.status, c.job.error)
    return a, b


def figure(html: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}">([^<]*)<', html)
    assert match, element_id
    return match.group(1)


def test_anonymous_front_page_shows_totals_and_names_no_customer_job_or_dataset(two_customers, contributor):
    a, b = two_customers
    accuracy = f"accuracy {b.job.metrics['test_accuracy']:.3f}"
    owner_home = b.client.get("/").content.decode()
    owner_sees = [b.user.username, f"/jobs/{b.job.pk}/", f"Job {b.job.pk}"]
    assert found(owner_home, owner_sees) == owner_sees and accuracy in owner_home

    response = Client().get("/")

    html = response.content.decode()
    assert response.status_code == 200
    delivered = WorkUnit.objects.filter(status=WorkUnit.Status.ACCEPTED).values_list("flops", flat=True)
    assert sum(delivered) > 0
    assert (figure(html, "devices-online"), figure(html, "jobs-run"), figure(html, "jobs-succeeded")) == ("1", "2", "2")
    shown = re.search(r'id="hu-delivered"><span class="figure-value" title="([^"]*)">([^<]*)<', html)
    assert shown[2] == figures.hu_text(sum(delivered))  # as people read it; every digit on hover
    assert hu_str(flops_to_hu(sum(delivered))) in shown[1]
    assert found(html, a.traces() + b.traces() + [contributor.username, "rig-quasar", "mlp"]) == []
    assert "accuracy" not in html


def test_a_customer_never_sees_another_customers_name_jobs_or_datasets(two_customers):
    a, b = two_customers
    b_pages = "".join(b.client.get(url).content.decode() for url in ("/", "/datasets/"))
    assert sorted(found(b_pages, b.traces())) == sorted(b.traces())  # B's own pages name all of them

    a_client = a.client
    a_urls = ["/", "/jobs/", f"/jobs/{a.job.pk}/", f"/jobs/{a.job.pk}/progress", "/datasets/",
              f"/datasets/{a.dataset.pk}/", "/jobs/new/", "/balance/"]
    a_pages = {url: a_client.get(url) for url in a_urls}

    assert {url: r.status_code for url, r in a_pages.items()} == dict.fromkeys(a_urls, 200)
    assert f"/jobs/{a.job.pk}/" in a_pages["/"].content.decode()  # A's home lists A's own job
    assert {url: found(r.content.decode(), b.traces()) for url, r in a_pages.items()} == dict.fromkeys(a_urls, [])
    assert a_client.get(f"/jobs/{b.job.pk}/").status_code == 404
    assert a_client.get(f"/datasets/{b.dataset.pk}/").status_code == 404


def test_contributors_and_staff_see_no_customers_jobs_on_the_front_page(two_customers, contributor, staff):
    a, b = two_customers

    pages = {}
    for user in (contributor, staff):
        client = Client()
        client.force_login(user)
        pages[user.username] = client.get("/").content.decode()

    assert {name: found(html, a.traces() + b.traces()) for name, html in pages.items()} == {"bob": [], "staff": []}
    assert all("Your recent jobs" not in html and "Jobs run" in html for html in pages.values())
