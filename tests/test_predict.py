"""What a customer takes home: predictions on the site (POST /api/jobs/<id>/predict) and the downloaded package
loaded with `muninn_worker.load_model` agree exactly, for a CSV job with a categorical column and missing cells,
an image job and a text job; bad input is a 400 naming the row and column; another customer's model is a 404."""
from __future__ import annotations

import csv
import io
import zipfile
from datetime import timedelta

import numpy as np
import pytest
import torch
from django.utils import timezone
from muninn_worker import datasets, load_model
from muninn_worker.samples import generated_text, synthetic_images
from PIL import Image

from accounts import services as accounts
from jobs import storage, tasks
from jobs.models import Job, PredictionBatch

from .test_spine import run_until_done
from .test_templates_flow import create_job, download, shapes_zip, upload

pytestmark = pytest.mark.django_db(transaction=True)


def people_csv(rows: int = 160) -> bytes:
    """A table with a categorical column, missing cells in a numeric and a categorical column, and a label that
    depends on both (so the model learns something worth predicting)."""
    rng = np.random.default_rng(0)
    lines = ["age,colour,height,bought"]
    for i in range(rows):
        age, colour, height = int(rng.integers(18, 80)), ["red", "blue", "green"][i % 3], rng.normal(1.7, 0.1)
        bought = "yes" if (age > 45) != (colour == "blue") else "no"
        lines.append(f"{'' if i % 9 == 0 else age},{'' if i % 13 == 0 else colour},{height:.3f},{bought}")
    return ("\n".join(lines) + "\n").encode()


def onnx_agrees(api, job: Job, model, inputs) -> None:
    """The job's ONNX export (?format=onnx), run by onnxruntime on the package's encoded inputs, answers what the
    package's torch module answers (within float32 rounding: the graph and torch's kernels sum in other orders)."""
    import onnxruntime

    answer = api.get(f"/api/jobs/{job.pk}/model?format=onnx")
    assert answer.status_code == 200, answer.content
    session = onnxruntime.InferenceSession(b"".join(answer.streaming_content), providers=["CPUExecutionProvider"])
    got = session.run(["output"], {"input": inputs.numpy()})[0]
    want = model.outputs(inputs).numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, float(np.abs(want).max()))
    if model.task == "classification":
        assert (got.argmax(-1) == want.argmax(-1)).all()


def png(image: np.ndarray) -> bytes:
    raw = io.BytesIO()
    Image.fromarray(image).save(raw, format="PNG")
    return raw.getvalue()


@pytest.fixture
def csv_job(customer_api, make_device) -> Job:
    dataset = upload(customer_api, people_csv(), "people.csv")
    job = create_job(customer_api, dataset["id"], "mlp", 2, hparams={"hidden": [16], "epochs": 3})
    done = run_until_done([make_device()], job["id"])
    assert done.status == Job.Status.SUCCEEDED
    return done


def _predict(api, job: Job, body: dict, **kwargs):
    fmt = kwargs.pop("fmt", "json")
    return api.post(f"/api/jobs/{job.pk}/predict" + ("?format=csv" if fmt == "csv" else ""), body,
                    format="multipart" if "file" in body else "json", **kwargs)


def test_a_csv_jobs_site_predictions_and_the_downloaded_package_agree_exactly(csv_job, customer_api, tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(download(customer_api, csv_job.pk))
    model = load_model(path)  # what a data scientist does, with nothing of the site
    rows = [{"height": 1.62, "colour": "blue", "age": 61},  # any column order
            {"age": None, "colour": "red", "height": "1.80"},  # a missing age: filled as in training
            {"age": 30, "colour": "", "height": 1.75, "bought": "?"}]  # a missing colour; the target is ignored

    site = _predict(customer_api, csv_job, {"rows": rows})

    assert site.status_code == 200, site.content
    answer = site.json()
    assert answer["task"] == "classification"
    assert answer["predictions"] == model.predict(rows)  # bit for bit: the same package, the same code
    first = answer["predictions"][0]
    assert first["row"] == 1 and first["label"] in ("no", "yes")
    assert set(first["probabilities"]) == {"no", "yes"} and abs(sum(first["probabilities"].values()) - 1) < 1e-6
    # The training file itself, as CSV text and as a batch upload answered in CSV, predicts as training encoded it.
    training = people_csv()
    parsed = datasets.parse_dataset(training, "csv")
    inputs, lines = model.encode(training.decode())
    assert np.array_equal(inputs.numpy(), parsed.X) and lines[0] == 2
    from_text = _predict(customer_api, csv_job, {"csv": training.decode()}).json()["predictions"]
    assert from_text == model.predict(training)
    batch = _predict(customer_api, csv_job, {"file": io.BytesIO(training)}, fmt="csv")
    assert batch.status_code == 200 and batch["Content-Type"].startswith("text/csv")
    table = list(csv.DictReader(io.StringIO(batch.content.decode())))
    assert [r["prediction"] for r in table] == [p["label"] for p in from_text]
    assert [float(r["p(yes)"]) for r in table] == [p["probabilities"]["yes"] for p in from_text]
    truth = [row["bought"] for row in csv.DictReader(io.StringIO(training.decode()))]
    learned = np.mean([p["label"] == label for p, label in zip(from_text, truth)])
    assert learned > 0.6  # a model, not noise
    onnx_agrees(customer_api, csv_job, model, model.encode(rows)[0])


BAD_INPUT = [
    ({"rows": [{"age": 40, "colour": "red", "height": "tall"}]}, "bad_number", ["row 1", "'height'"]),
    ({"rows": [{"age": 40, "colour": "purple", "height": 1.7}]}, "bad_category", ["row 1", "'colour'", "'purple'"]),
    ({"rows": [{"age": 40, "colour": "red", "height": None}]}, "missing_value", ["row 1", "'height'"]),
    ({"csv": "age,colour\n40,red\n"}, "missing_column", ["'height'"]),
    ({"csv": "age,colour,height\n40,red,1.7\n41,blue\n"}, "ragged_row", ["row 3"]),
    ({"rows": []}, "no_rows", ["nothing to predict"]),
    ({"prompt": "hello"}, "bad_input", ["not a prompt"]),
    ({}, "bad_input", ["exactly one input"]),
    ({"file": io.BytesIO(b"age,colour,height\n\xff,red,1\n")}, "bad_encoding", ["row 2", "UTF-8"]),
]


def test_bad_predict_input_is_a_400_naming_the_row_and_column(csv_job, customer_api):
    for body, code, words in BAD_INPUT:  # one job for all: a job per case would cost seconds each
        answer = _predict(customer_api, csv_job, body)

        assert answer.status_code == 400, (body, answer.content)
        error = answer.json()["error"]
        assert error["code"] == code, (body, error)
        assert all(word in error["message"] for word in words), error["message"]


def test_another_customers_model_is_a_404_and_an_unfinished_job_a_409(csv_job, customer_api, make_device):
    stranger = accounts.user_create(username="eve", email="eve@example.com", password="eve-pass-123",
                                    role="customer")
    from rest_framework.test import APIClient
    other = APIClient()
    other.force_authenticate(stranger)
    assert _predict(other, csv_job, {"rows": [{"age": 1, "colour": "red", "height": 1}]}).status_code == 404
    dataset = upload(customer_api, people_csv(), "again.csv")
    waiting = create_job(customer_api, dataset["id"], "mlp", 1)
    refused = customer_api.post(f"/api/jobs/{waiting['id']}/predict", {"csv": "age\n1\n"}, format="json")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_ready"


def test_an_image_jobs_site_predictions_and_package_agree_on_an_image_and_a_zip(customer_api, make_device):
    dataset = upload(customer_api, shapes_zip(), "shapes.zip")
    job = create_job(customer_api, dataset["id"], "cnn", 1, hparams={"image_size": 16, "epochs": 1})
    done = run_until_done([make_device()], job["id"])
    model = load_model(download(customer_api, done.pk))
    images, _ = synthetic_images(seed=5, per_class=1, size=20)  # another size: resized as in training
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        for i, image in enumerate(images):
            z.writestr(f"new/{i}.png", png(image))

    one = customer_api.post(f"/api/jobs/{done.pk}/predict", {"file": io.BytesIO(png(images[0]))},
                            format="multipart")
    many = customer_api.post(f"/api/jobs/{done.pk}/predict", {"file": io.BytesIO(archive.getvalue())},
                             format="multipart")

    assert one.status_code == 200, one.content
    assert one.json()["predictions"][0]["probabilities"] == model.predict(png(images[0]))[0]["probabilities"]
    assert many.json()["predictions"] == model.predict(archive.getvalue(), name="batch.zip")
    assert [p["row"] for p in many.json()["predictions"]] == [f"new/{i}.png" for i in range(len(images))]
    assert set(many.json()["predictions"][0]["probabilities"]) == {"box", "h", "v"}
    onnx_agrees(customer_api, done, model, model.encode(archive.getvalue(), name="batch.zip")[0])
    broken = customer_api.post(f"/api/jobs/{done.pk}/predict", {"file": io.BytesIO(b"not an image")},
                               format="multipart")
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "bad_image"


def test_a_text_jobs_site_generation_and_package_agree(customer_api, make_device):
    dataset = upload(customer_api, generated_text(seed=0, sentences=300).encode(), "story.txt")
    job = create_job(customer_api, dataset["id"], "transformer", 1,
                     hparams={"d_model": 32, "layers": 1, "heads": 2, "context": 32})
    done = run_until_done([make_device()], job["id"])
    model = load_model(download(customer_api, done.pk))

    site = customer_api.post(f"/api/jobs/{done.pk}/predict", {"prompt": "the ", "length": 40}, format="json")
    sampled = customer_api.post(f"/api/jobs/{done.pk}/predict",
                                {"prompt": "the ", "length": 40, "temperature": 0.8, "seed": 7}, format="json")

    assert site.status_code == 200, site.content
    assert site.json() == {"task": "language_model", "prompt": "the ", "text": model.generate("the ", 40)}
    assert len(site.json()["text"]) == 40  # a character vocabulary: one token, one character
    assert sampled.json()["text"] == model.generate("the ", 40, temperature=0.8, seed=7)
    prompt_ids = torch.tensor([[model.spec["vocab"].index(c) for c in "the " + site.json()["text"][:20]]])
    onnx_agrees(customer_api, done, model, prompt_ids)
    unknown = customer_api.post(f"/api/jobs/{done.pk}/predict", {"prompt": "日本"}, format="json")
    assert unknown.status_code == 400 and "character 1 of the prompt" in unknown.json()["error"]["message"]
    too_long = customer_api.post(f"/api/jobs/{done.pk}/predict", {"prompt": "the ", "length": 10**6}, format="json")
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "bad_length"


def test_a_file_is_predicted_in_the_background_with_its_progress_and_errors_kept(csv_job, customer_api):
    training = people_csv()
    accepted = customer_api.post(f"/api/jobs/{csv_job.pk}/predictions",
                                 {"file": io.BytesIO(training)}, format="multipart")

    assert accepted.status_code == 202, accepted.content
    batch = customer_api.get(f"/api/jobs/{csv_job.pk}/predictions/{accepted.json()['id']}").json()
    assert batch["status"] == "done" and batch["rows"] == batch["done_rows"] == 160  # tests run tasks eagerly
    table = customer_api.get(batch["csv_url"])
    assert table.status_code == 200 and table["Content-Type"].startswith("text/csv")
    sync = _predict(customer_api, csv_job, {"file": io.BytesIO(training)}, fmt="csv")
    assert table.content == sync.content  # the same predictions as the request's own answer
    bad = customer_api.post(f"/api/jobs/{csv_job.pk}/predictions",
                            {"file": io.BytesIO(b"age,colour,height\n40,purple,1.7\n")}, format="multipart").json()
    failed = customer_api.get(f"/api/jobs/{csv_job.pk}/predictions/{bad['id']}").json()
    assert failed["status"] == "failed" and failed["csv_url"] is None
    assert failed["error"]["code"] == "bad_category" and "row 2, column 'colour'" in failed["error"]["message"]
    assert customer_api.get(f"/api/jobs/{csv_job.pk}/predictions/{bad['id']}/csv").status_code == 409
    stranger = accounts.user_create(username="mallory", email="m@example.com", password="mallory-pass-123",
                                    role="customer")
    from rest_framework.test import APIClient
    other = APIClient()
    other.force_authenticate(stranger)
    assert other.get(f"/api/jobs/{csv_job.pk}/predictions/{accepted.json()['id']}").status_code == 404
    assert other.get(batch["csv_url"]).status_code == 404
    # A batch whose message was lost (queued minutes ago, never run) is predicted by beat's stalled-work sweep.
    lost = PredictionBatch.objects.create(job=csv_job, filename="lost.csv", input_sha256=storage.blob_put(training),
                                          size_bytes=len(training))
    PredictionBatch.objects.filter(pk=lost.pk).update(created_at=timezone.now() - timedelta(minutes=5))
    tasks.resume_stalled_jobs()
    lost.refresh_from_db()
    assert lost.status == "done" and lost.rows == 160
