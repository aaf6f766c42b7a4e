"""The job page tells the customer what an image model takes: pixels as uploaded (raw 0–255 for a zip of images),
channels first, never scaled to 0–1 (the model standardises them itself)."""
from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
from django.test import Client
from PIL import Image

from billing.models import Quote
from jobs.models import Dataset, Job

from .conftest import digits_npz, named_file

pytestmark = pytest.mark.django_db


@pytest.fixture
def client(customer) -> Client:
    client = Client()
    client.force_login(customer)
    return client


def job_page(client: Client, upload: io.BytesIO, template: str) -> str:
    response = client.post("/datasets/", {"file": upload})
    assert response.status_code == 302, response.content.decode()[:2000]
    dataset = Dataset.objects.latest("id")
    fields = {"dataset": dataset.pk, "template": template, "rounds": 1, "aggregation": "fedavg"}
    client.post("/jobs/new/", {**fields, "action": "quote"})
    client.post("/jobs/new/", {**fields, "action": "accept", "quote": Quote.objects.latest("created_at").pk})
    return client.get(f"/jobs/{Job.objects.latest('id').pk}/").content.decode()


def shapes_zip() -> io.BytesIO:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for label, colour in (("red", (255, 0, 0)), ("blue", (0, 0, 255))):
            for i in range(6):
                img = io.BytesIO()
                Image.new("RGB", (16, 16), tuple(min(255, v + 10 * i) for v in colour)).save(img, "PNG")
                zf.writestr(f"{label}/{i}.png", img.getvalue())
    return named_file(buf.getvalue(), "shapes.zip")


def test_an_image_job_page_says_the_model_takes_raw_0_255_channel_first_pixels(client):
    page = job_page(client, shapes_zip(), "cnn")

    assert 'id="model-input"' in page
    assert "float32 [batch, 3, " in page and "channels first" in page
    assert "raw 0–255 pixel values (RGB)" in page and "Do not divide by 255" in page


def test_an_npz_image_job_page_says_the_scale_is_the_uploads(client):
    images = np.random.default_rng(0).uniform(0, 16, size=(60, 8, 8)).astype(np.float32)
    buf = io.BytesIO()
    np.savez(buf, X=images, y=np.arange(60) % 3)

    page = job_page(client, named_file(buf.getvalue(), "grey.npz"), "cnn")

    assert "float32 [batch, 1, 8, 8]" in page and "the same scale as the X array you uploaded" in page


def test_a_table_job_page_has_no_pixel_note(client):
    page = job_page(client, named_file(digits_npz(200), "digits.npz"), "mlp")

    assert Job.objects.count() == 1 and 'id="model-input"' not in page
