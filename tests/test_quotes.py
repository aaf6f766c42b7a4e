"""Quotes: a binding price with a device tier and an expected wall time; starting a job accepts one."""
from __future__ import annotations

import io
from datetime import timedelta

import numpy as np
import pytest
from django.test import Client
from django.utils import timezone
from muninn_worker.samples import synthetic_images

from billing import pricing
from billing import selectors as ledger
from billing.models import Quote, Transaction
from jobs.models import Job

from .conftest import CAPABILITIES, SimulatedDevice, _named

pytestmark = pytest.mark.django_db(transaction=True)
GIB = 2**30


def test_device_tier_is_the_smallest_that_holds_the_peak_memory():
    assert pricing.device_tier(10 * 2**20).name == "S"
    assert pricing.device_tier(2 * GIB).name == "S"
    assert pricing.device_tier(2 * GIB + 1).name == "M"
    assert pricing.device_tier(80 * GIB).name == "XL"
    with pytest.raises(pricing.TooBigForAnyTier):
        pricing.device_tier(81 * GIB)


def test_expected_wall_time_divides_the_work_by_the_devices_combined_speed():
    seconds = pricing.expected_wall_seconds(flops_per_round=2000, rounds=3, device_flops_per_s=[100.0, 300.0],
                                            round_overhead_seconds=5.0)
    assert seconds == 3 * (2000 / 400 + 5)
    assert pricing.expected_wall_seconds(flops_per_round=1000, rounds=1, device_flops_per_s=[0.0],
                                         round_overhead_seconds=5.0) is None


def test_the_tier_line_names_the_backend_the_units_go_to():
    small = pricing.device_tier(10 * 2**20)
    assert pricing.tier_line(small, ("cuda",)) == "S — NVIDIA GPU (CUDA) only: a GPU with 2 GiB free"
    assert pricing.tier_line(small, ("cpu",)) == "S — CPU: any device with 2 GiB of memory free"


def quote(api, dataset_id: int, **extra) -> dict:
    response = api.post("/api/quotes", {"dataset": dataset_id, "template": "mlp", "rounds": 2, **extra}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def test_quote_has_price_tier_and_wall_time_from_the_devices_online(customer_api, digits_dataset, make_device):
    make_device("a"), make_device("b")

    q = quote(customer_api, digits_dataset["id"])
    estimate = customer_api.post("/api/estimates", {"dataset": digits_dataset["id"], "template": "mlp",
                                                    "rounds": 2}, format="json").json()

    assert q["flops"] == estimate["flops"] and q["price"] == estimate["price"] and q["hu"] == estimate["hu"]
    assert q["device_tier"]["name"] == "S" and q["device_tier"]["memory_bytes"] >= q["peak_memory_bytes"]
    assert q["devices_online"] == 2 and q["expected_seconds"] > 0
    assert q["job"] is None and q["expires_at"]
    assert customer_api.get(f"/api/quotes/{q['id']}").json()["id"] == q["id"]


def test_quote_with_no_device_online_has_no_wall_time(customer_api, digits_dataset):
    q = quote(customer_api, digits_dataset["id"])
    assert q["devices_online"] == 0 and q["expected_seconds"] is None


def test_accepting_a_quote_starts_the_job_and_holds_the_quoted_price(customer_api, customer, digits_dataset):
    q = quote(customer_api, digits_dataset["id"])
    before = ledger.balances_for(user=customer)["customer_available"]

    response = customer_api.post(f"/api/quotes/{q['id']}/accept")

    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert job.status == Job.Status.RUNNING and job.flops_estimated == q["flops"]
    assert ledger.job_money(job=job)["quoted"] == q["price"]["nanos"]
    assert ledger.balances_for(user=customer)["customer_available"] == before - q["price"]["nanos"]
    assert Quote.objects.get(pk=q["id"]).job == job


def test_expired_quote_is_refused_and_nothing_changes(customer_api, customer, digits_dataset):
    q = quote(customer_api, digits_dataset["id"])
    Quote.objects.filter(pk=q["id"]).update(expires_at=timezone.now() - timedelta(seconds=1))
    transactions = Transaction.objects.count()

    response = customer_api.post(f"/api/quotes/{q['id']}/accept")

    assert response.status_code == 410
    assert response.json()["error"]["code"] == "quote_expired" and "expired" in response.json()["error"]["message"]
    assert not Job.objects.exists()
    assert Transaction.objects.count() == transactions


def test_starting_a_created_job_with_an_expired_quote_is_refused_and_the_job_stays_created(customer_api,
                                                                                          digits_dataset):
    q = quote(customer_api, digits_dataset["id"])
    job = customer_api.post("/api/jobs", {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 2},
                            format="json").json()
    Quote.objects.filter(pk=q["id"]).update(expires_at=timezone.now() - timedelta(seconds=1))

    response = customer_api.post(f"/api/jobs/{job['id']}/start", {"quote": q["id"]}, format="json")

    assert response.status_code == 410 and response.json()["error"]["code"] == "quote_expired"
    assert Job.objects.get(pk=job["id"]).status == Job.Status.CREATED
    assert not Transaction.objects.filter(kind=Transaction.Kind.HOLD).exists()
    assert Quote.objects.get(pk=q["id"]).job is None


def test_a_quote_is_accepted_once(customer_api, digits_dataset):
    q = quote(customer_api, digits_dataset["id"])
    assert customer_api.post(f"/api/quotes/{q['id']}/accept").status_code == 201

    again = customer_api.post(f"/api/quotes/{q['id']}/accept")

    assert again.status_code == 409 and again.json()["error"]["code"] == "quote_used"
    assert Job.objects.count() == 1


def test_starting_a_job_with_a_quote_for_another_job_is_refused(customer_api, digits_dataset):
    q = quote(customer_api, digits_dataset["id"])

    response = customer_api.post("/api/jobs", {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 5,
                                               "start": True, "quote": q["id"]}, format="json")

    assert response.status_code == 400 and response.json()["error"]["code"] == "quote_mismatch"
    assert not Job.objects.exists()


def test_a_job_started_with_its_quote_holds_the_quoted_price_even_if_the_price_rises(customer_api, digits_dataset,
                                                                                   settings):
    q = quote(customer_api, digits_dataset["id"])
    settings.MUNINN_PRICE_PER_HU = settings.MUNINN_PRICE_PER_HU * 10

    response = customer_api.post("/api/jobs", {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 2,
                                               "start": True, "quote": q["id"]}, format="json")

    assert response.status_code == 201, response.content
    assert ledger.job_money(job=Job.objects.get(pk=response.json()["id"]))["quoted"] == q["price"]["nanos"]


def test_a_job_started_without_a_quote_gets_one_at_the_current_price(customer_api, digits_dataset):
    response = customer_api.post("/api/jobs", {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 2,
                                               "start": True}, format="json")

    job = Job.objects.get(pk=response.json()["id"])
    assert job.quote.price == ledger.job_money(job=job)["quoted"] > 0


@pytest.fixture
def shapes_dataset(customer_api) -> dict:
    images, labels = synthetic_images(per_class=8, size=8)
    buffer = io.BytesIO()
    np.savez(buffer, X=images, y=labels)
    response = customer_api.post("/api/datasets", {"file": _named(buffer.getvalue(), "shapes.npz")},
                                 format="multipart")
    assert response.status_code == 201, response.content
    return response.json()


RESNET18 = {"template": "resnet18", "hparams": {"base_width": 8, "image_size": 16, "batch_size": 8}}


def test_a_resnet18_quote_names_cuda_and_warns_when_no_cuda_device_was_seen(customer_api, shapes_dataset,
                                                                            make_device):
    make_device("laptop")  # a CPU-only device online: it cannot take resnet18's units

    q = quote(customer_api, shapes_dataset["id"], **RESNET18)

    assert q["device_tier"]["line"] == "S — NVIDIA GPU (CUDA) only: a GPU with 2 GiB free"
    assert q["device_tier"]["backends"] == ["cuda"]
    assert q["devices_online"] == 0 and q["devices_recent"] == 0
    assert q["device_tier"]["warning"].startswith(
        "No device that can run this job (NVIDIA GPU (CUDA) only: a GPU with 2 GiB free) has been online in the "
        "last 24 hours. If you start it, its price is held while it waits for one")


def test_a_quote_does_not_warn_when_a_capable_device_was_seen_lately(customer_api, shapes_dataset, contributor,
                                                                    settings):
    rig = SimulatedDevice(contributor, "rig")
    rig.device.capabilities = {**CAPABILITIES, "backends": ["cpu", "cuda"],
                               "gpus": [{"name": "RTX 4090", "memory_bytes": 24 * 2**30}]}
    rig.device.gpu_memory_bytes = 24 * 2**30
    rig.device.last_seen_at = timezone.now() - timedelta(hours=3)  # offline now, but seen today
    rig.device.save()

    q = quote(customer_api, shapes_dataset["id"], **RESNET18)

    assert q["devices_online"] == 0 and q["devices_recent"] == 1 and q["device_tier"]["warning"] is None
    settings.MUNINN_DEVICE_RECENT_SECONDS = 3600
    assert quote(customer_api, shapes_dataset["id"], **RESNET18)["device_tier"]["warning"] is not None


def test_the_new_job_page_shows_the_tier_line_and_the_warning(customer, shapes_dataset):
    client = Client()
    client.force_login(customer)
    page = client.post("/jobs/new/", {"dataset": shapes_dataset["id"], "template": "resnet18",
                                               "rounds": 1, "aggregation": "fedavg", "hp-resnet18-base_width": "8",
                                               "hp-resnet18-image_size": "16", "hp-resnet18-batch_size": "8",
                                               "action": "quote"}).content.decode()

    assert "S — NVIDIA GPU (CUDA) only: a GPU with 2 GiB free" in page
    assert "No device that can run this job" in page
