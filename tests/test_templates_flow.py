"""New templates and formats through the site's job flow: upload, plan, rounds on simulated devices (real
training through the worker API), the template's metric recorded per round, the artefacts downloaded."""
from __future__ import annotations

import io

import numpy as np
import pytest
from django.test import Client
from muninn_worker import tensors
from muninn_worker.samples import generated_text, image_folder_zip, synthetic_images
from sklearn.datasets import load_diabetes, load_digits

from contributors import services as contributors
from jobs.models import Job, WorkUnit

from .conftest import CAPABILITIES, SimulatedDevice, named_file
from .test_spine import assert_ledger_consistent, run_until_done

pytestmark = pytest.mark.django_db(transaction=True)


def upload(api, data: bytes, name: str, **options) -> dict:
    response = api.post("/api/datasets", {"file": named_file(data, name), **options}, format="multipart")
    assert response.status_code == 201, response.content
    return response.json()


def create_job(api, dataset: int, template: str, rounds: int, **extra) -> dict:
    response = api.post("/api/jobs", {"dataset": dataset, "template": template, "rounds": rounds, "seed": 3,
                                      "start": True, **extra}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def download(api, job_id: int, artefact: str = "model") -> bytes:
    response = api.get(f"/api/jobs/{job_id}/model?artefact={artefact}")
    assert response.status_code == 200, response.content
    return b"".join(response.streaming_content)


def test_template_registry_is_listed_with_bounds(customer_api):
    listed = {t["name"]: t for t in customer_api.get("/api/templates").json()}

    assert set(listed) == {"mlp", "cnn", "resnet18", "transformer", "lora"}
    assert listed["resnet18"]["tier"] == "gpu"
    assert {h["name"]: h["default"] for h in listed["cnn"]["hparams"]}["filters"] == [16, 32]


def test_diabetes_csv_regression_records_rmse_per_round(customer, customer_api, make_device):
    diabetes = load_diabetes()
    rows = [",".join([*map(repr, x), str(int(t))]) for x, t in zip(diabetes.data.tolist(), diabetes.target)]
    data = ("\n".join([",".join([*diabetes.feature_names, "progression"]), *rows]) + "\n").encode()
    dataset = upload(customer_api, data, "diabetes.csv")
    assert dataset["profile"]["task"] == "regression"

    job = create_job(customer_api, dataset["id"], "mlp", 3,
                     hparams={"hidden": [32], "epochs": 5, "lr": 0.005, "batch_size": 32})
    done = run_until_done([make_device("a"), make_device("b")], job["id"])

    rounds = list(done.round_set.order_by("number"))
    assert done.status == Job.Status.SUCCEEDED and done.model_config["task"] == "regression"
    assert all("test_rmse" in r.metrics and "test_accuracy" not in r.metrics for r in rounds)
    std = dataset["profile"]["target_stats"]["std"]
    assert rounds[-1].metrics["test_rmse"] < 0.85 * std  # well below predicting the mean
    assert done.metrics["target"] == "progression"
    assert_ledger_consistent(done)
    owner = Client()
    owner.force_login(customer)
    assert f"RMSE {rounds[-1].metrics['test_rmse']:.3f}" in owner.get("/").content.decode()  # their front page


def test_digits_images_train_a_cnn_on_two_devices(customer_api, make_device):
    digits = load_digits()
    buffer = io.BytesIO()
    np.savez(buffer, X=digits.images.astype(np.float32), y=digits.target)
    dataset = upload(customer_api, buffer.getvalue(), "digits.npz")

    devices = [make_device("a"), make_device("b")]
    assert all(device.claim() is None for device in devices)  # both online before the job: each gets a shard
    job = create_job(customer_api, dataset["id"], "cnn", 2, hparams={"epochs": 3})
    done = run_until_done(devices, job["id"])

    assert done.model_config == {"channels": 1, "height": 8, "width": 8, "num_classes": 10, "filters": [16, 32]}
    # round 2's shards follow the speeds measured in round 1: both devices, unless the clock found one far slower
    # (a loaded machine)
    units = [r.metrics["units"] for r in done.round_set.order_by("number")]
    assert units[0] == 2 and units[1] in (1, 2)
    assert done.metrics["test_accuracy"] >= 0.9


def shapes_zip() -> bytes:
    return image_folder_zip(*synthetic_images(per_class=12, size=12), ["h", "v", "box"])


def test_a_zip_of_class_folders_trains_a_cnn_at_the_chosen_size(customer_api, make_device):
    dataset = upload(customer_api, shapes_zip(), "shapes.zip")

    job = create_job(customer_api, dataset["id"], "cnn", 1, hparams={"image_size": 16, "epochs": 1})
    done = run_until_done([make_device()], job["id"])

    assert dataset["profile"]["classes"] == ["box", "h", "v"]
    assert (done.model_config["height"], done.model_config["channels"]) == (16, 3)
    assert "test_accuracy" in done.metrics


def test_text_lm_then_lora_on_its_uploaded_weights_only_moves_adapters(customer_api, make_device):
    text = upload(customer_api, generated_text(seed=0, sentences=400).encode(), "story.txt", tokenizer="byte")
    lm = create_job(customer_api, text["id"], "transformer", 1,
                    hparams={"d_model": 32, "layers": 1, "heads": 2, "context": 32})
    lm_device = make_device("lm")
    lm_done = run_until_done([lm_device], lm["id"])
    assert lm_done.metrics["test_perplexity"] < 256  # byte vocabulary
    base = upload(customer_api, download(customer_api, lm_done.pk), "base.safetensors")
    assert base["format"] == "weights" and base["profile"]["model_config"]["heads"] == 2
    new_text = upload(customer_api, generated_text(seed=1, sentences=400, style="b").encode(), "new.txt",
                      tokenizer="byte")
    devices = [lm_device, make_device("b")]
    assert lm_device.claim() is None  # it polls (still online after a slow first job): each gets a shard

    job = create_job(customer_api, new_text["id"], "lora", 2, base_weights=base["id"], hparams={"rank": 2})
    done = run_until_done(devices, job["id"])

    rounds = list(done.round_set.order_by("number"))
    assert done.status == Job.Status.SUCCEEDED
    assert rounds[-1].metrics["test_perplexity"] < rounds[0].metrics["test_perplexity"]  # the adapters learn
    assert rounds[0].metrics["units"] == 2 and all(r.metrics["units"] in (1, 2) for r in rounds)  # measured speeds
    adapters = tensors.bytes_to_state_dict(download(customer_api, done.pk))
    merged = tensors.bytes_to_state_dict(download(customer_api, done.pk, "merged"))
    base_state = tensors.bytes_to_state_dict(download(customer_api, lm_done.pk))
    assert all(k.endswith((".lora_a", ".lora_b")) for k in adapters)
    assert set(merged) == set(base_state)
    assert not all(np.allclose(merged[k], base_state[k]) for k in merged)
    result_bytes = max(len(tensors.state_dict_to_bytes(adapters)), 1)
    assert result_bytes < 0.25 * base["size_bytes"]  # what travels each round, next to the full model
    assert all(u.result_sha256 for u in WorkUnit.objects.filter(round__job_id=done.pk, status="accepted"))
    assert_ledger_consistent(done)


def test_incompatible_choices_are_refused_with_a_sentence(customer_api, digits_dataset):
    text = upload(customer_api, generated_text(sentences=50).encode(), "story.txt")

    cnn_on_table = customer_api.post("/api/jobs", {"dataset": digits_dataset["id"], "template": "cnn",
                                                   "rounds": 1}, format="json")
    lora_without_base = customer_api.post("/api/jobs", {"dataset": text["id"], "template": "lora", "rounds": 1},
                                          format="json")
    mlp_on_text = customer_api.post("/api/jobs", {"dataset": text["id"], "template": "mlp", "rounds": 1},
                                    format="json")

    for response, words in ((cnn_on_table, "images"), (lora_without_base, "base weights"), (mlp_on_text, "text")):
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "incompatible_data" and words in response.json()["error"]["message"]
    assert not Job.objects.exists()


def test_resnet18_units_go_only_to_gpu_devices(customer_api, contributor):
    images, labels = synthetic_images(per_class=8, size=8)
    buffer = io.BytesIO()
    np.savez(buffer, X=images, y=labels)
    dataset = upload(customer_api, buffer.getvalue(), "shapes.npz")
    cpu = SimulatedDevice(contributor, "laptop")
    gpu = SimulatedDevice(contributor, "rig")
    gpu.device.capabilities = {**CAPABILITIES, "backends": ["cpu", "cuda"],
                               "gpus": [{"name": "RTX 4090", "memory_bytes": 24 * 2**30}]}
    gpu.device.gpu_memory_bytes = 24 * 2**30
    gpu.device.save()

    job = create_job(customer_api, dataset["id"], "resnet18", 1,
                     hparams={"base_width": 8, "image_size": 16, "batch_size": 8})

    assert Job.objects.get(pk=job["id"]).round_set.get().units.count() == 1  # sharded for the GPU device only
    assert cpu.claim() is None
    assert contributors.unit_claim(device=gpu.device) is not None


def test_an_image_size_too_large_to_decode_is_refused_before_anything_is_made(customer_api, monkeypatch):
    from muninn_worker import datasets
    dataset = upload(customer_api, shapes_zip(), "shapes.zip")
    monkeypatch.setattr(datasets.images, "MAX_DECODED_ELEMENTS", 36 * 3 * 64 * 64 - 1)

    response = customer_api.post("/api/jobs", {"dataset": dataset["id"], "template": "cnn", "rounds": 1,
                                               "hparams": {"image_size": 64}}, format="json")

    assert response.status_code == 400
    assert response.json()["error"]["code"] == "too_large" and "image_size" in response.json()["error"]["message"]
    assert not Job.objects.exists()
