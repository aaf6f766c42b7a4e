"""ONNX export of trained models (muninn_worker.onnx_export, GET /api/jobs/<id>/model?format=onnx): onnxruntime
answers what torch answers, within 1e-4 of the output's scale, on the tensor the torch model takes (the model's
normalisation inside the graph), at batch sizes (and text lengths) other than the export's."""
from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from django.test import Client
from muninn_worker import datasets, onnx_export, preparation, tensors, zoo
from rest_framework.test import APIClient

from accounts import services as accounts
from accounts.models import User
from jobs import storage
from jobs.models import Job

from .conftest import digits_npz, named_file

TOLERANCE = 1e-4  # of the largest |output| (at least 1): float32 kernels of two runtimes, a few ulps per op


def session(model: bytes) -> onnxruntime.InferenceSession:
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])


def assert_agrees(model: bytes, torch_model: torch.nn.Module, x: torch.Tensor) -> None:
    got = session(model).run(["output"], {"input": x.numpy()})[0]
    with torch.no_grad():
        want = torch_model(x).numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOLERANCE * max(1.0, np.abs(want).max())


def trained(template: str, model_config: dict, X: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Weights as a job's: initialised, the normalisation buffers fitted to the data."""
    return zoo.get_template(template).fit_state(zoo.init_state(template, model_config, seed=1), X, y)


def torch_model(template: str, model_config: dict, state: dict) -> torch.nn.Module:
    model = zoo.build_model(template, model_config)
    model.load_state_dict(state)
    return model.eval()


def mixed_table() -> datasets.ParsedDataset:
    """A CSV with a categorical column (one-hot encoded into three features) and a missing number."""
    rng = np.random.default_rng(0)
    rows = ["height,colour,weight,kind"] + [
        f"{rng.normal(170, 10):.1f},{rng.choice(['red', 'green', 'blue'])},{rng.normal(70, 8):.1f},"
        f"{rng.choice(['a', 'b', 'c'])}" for _ in range(40)]
    rows[5] = "171.0,red,,a"
    return datasets.parse_dataset("\n".join(rows).encode(), "csv")


def test_an_mlp_on_a_table_with_a_categorical_column_runs_in_onnxruntime_as_in_torch():
    parsed = mixed_table()
    config = zoo.model_config_for("mlp", parsed.profile, zoo.validate_hparams("mlp", {"hidden": [16, 8]}))
    X, y = preparation.samples(parsed, config)
    state = trained("mlp", config, X, y)

    model = onnx_export.export("mlp", config, state)

    assert config["in_features"] == 5  # height, three colours, weight
    assert_agrees(model, torch_model("mlp", config, state), X[:7])
    assert_agrees(model, torch_model("mlp", config, state), X[:1])


def test_an_mlp_regression_answers_in_the_targets_units_in_onnxruntime_as_in_torch():
    config = {"in_features": 4, "hidden": [8], "task": "regression"}
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(30, 4, generator=generator) * 50 + 200
    state = trained("mlp", config, X, 1000 + 30 * torch.randn(30, generator=generator))

    model = onnx_export.export("mlp", config, state)

    assert session(model).get_outputs()[0].shape == ["batch"]
    assert_agrees(model, torch_model("mlp", config, state), X[:5])


@pytest.mark.parametrize("template, config", [
    ("cnn", {"channels": 3, "height": 12, "width": 10, "num_classes": 4, "filters": [4, 8]}),
    ("resnet18", {"channels": 1, "height": 16, "width": 16, "num_classes": 3, "base_width": 8}),
])
def test_an_image_model_takes_raw_pixels_in_onnxruntime_as_in_torch(template, config):
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (20, config["channels"], config["height"], config["width"]),
                           generator=generator).float()
    state = trained(template, config, pixels, torch.randint(0, config["num_classes"], (20,), generator=generator))

    model = onnx_export.export(template, config, state)

    assert_agrees(model, torch_model(template, config, state), pixels[:5])


def test_a_transformer_gives_next_token_logits_at_any_batch_and_length_up_to_its_context():
    config = {"vocab_size": 40, "context": 16, "d_model": 32, "layers": 2, "heads": 4}
    state = zoo.init_state("transformer", config, seed=1)
    ids = torch.randint(0, 40, (3, 16), generator=torch.Generator().manual_seed(0))

    model = onnx_export.export("transformer", config, state)

    assert session(model).get_inputs()[0].type == "tensor(int64)"
    assert_agrees(model, torch_model("transformer", config, state), ids)
    assert_agrees(model, torch_model("transformer", config, state), ids[:1, :5])


def test_the_export_says_what_it_takes_in_its_metadata_and_is_the_same_bytes_each_time():
    config = {"in_features": 3, "num_classes": 2, "hidden": []}
    state = zoo.init_state("mlp", config, seed=1)

    model = onnx_export.export("mlp", config, state, metadata={"muninn_job": "7"})

    proto = onnx.load_from_string(model)
    onnx.checker.check_model(proto)
    props = {p.key: p.value for p in proto.metadata_props}
    assert props["muninn_template"] == "mlp" and json.loads(props["muninn_model_config"]) == config
    assert props["muninn_input"].startswith("float32 [batch, 3]") and props["muninn_job"] == "7"
    assert props["muninn_input"] in proto.doc_string
    assert onnx_export.export("mlp", config, state, metadata={"muninn_job": "7"}) == model


def test_lora_adapters_are_refused_with_a_sentence_naming_the_merged_model():
    assert [t for t in zoo.TEMPLATES if not onnx_export.supported(t)] == ["lora"]
    with pytest.raises(onnx_export.NotExportable, match="merged transformer"):
        onnx_export.export("lora", {}, {})


# ------------------------------------------------------------------------------------------------ the API


def onnx_of(api, job_id: int, query: str = "") -> tuple[object, bytes]:
    response = api.get(f"/api/jobs/{job_id}/model?format=onnx{query}")
    assert response.status_code == 200, response.content
    return response, b"".join(response.streaming_content)


@pytest.fixture
def mlp_job(db, customer_api) -> int:
    """An mlp job on 60 digits, not started: its initial weights (normalisation fitted) are its model."""
    dataset = customer_api.post("/api/datasets", {"file": named_file(digits_npz(60), "digits.npz")},
                                format="multipart").json()
    return customer_api.post("/api/jobs", {"dataset": dataset["id"], "template": "mlp", "rounds": 1},
                             format="json").json()["id"]


def test_a_succeeded_jobs_onnx_download_runs_as_its_safetensors_model(customer_api, mlp_job):
    not_ready = customer_api.get(f"/api/jobs/{mlp_job}/model?format=onnx")
    Job.objects.filter(pk=mlp_job).update(status=Job.Status.SUCCEEDED)
    safetensors = b"".join(customer_api.get(f"/api/jobs/{mlp_job}/model").streaming_content)

    response, model = onnx_of(customer_api, mlp_job)

    assert not_ready.status_code == 409 and not_ready.json()["error"]["code"] == "not_ready"
    assert response["Content-Disposition"] == f'attachment; filename="muninn-job-{mlp_job}-mlp.onnx"'
    props = {p.key: p.value for p in onnx.load_from_string(model).metadata_props}
    config = Job.objects.get(pk=mlp_job).model_config
    X = torch.from_numpy(np.load(io.BytesIO(digits_npz(9)))["X"])
    assert json.loads(props["muninn_model_config"]) == config and json.loads(props["muninn_data"]) == list("0123456789")
    assert_agrees(model, torch_model("mlp", config, tensors.bytes_to_state_dict(safetensors)), X)
    assert storage.blob_exists(hashlib.sha256(model).hexdigest())  # kept for the next download
    assert onnx_of(customer_api, mlp_job)[1] == model


def test_a_bad_format_or_artefact_is_refused_with_a_sentence_and_another_customers_job_is_not_found(
        customer_api, mlp_job):
    Job.objects.filter(pk=mlp_job).update(status=Job.Status.SUCCEEDED)
    other = accounts.user_create(username="carol", password="carol-pass-123", role=User.Role.CUSTOMER)
    carol = APIClient()
    carol.credentials(HTTP_AUTHORIZATION=f"Token {accounts.token_for(user=other)}")

    refused = {query: customer_api.get(f"/api/jobs/{mlp_job}/model{query}") for query in (
        "?format=pickle", "?format=onnx&artefact=weights", "?format=onnx&artefact=merged")}
    by_carol = carol.get(f"/api/jobs/{mlp_job}/model?format=onnx")

    assert {query: (r.status_code, r.json()["error"]["code"]) for query, r in refused.items()} == {
        "?format=pickle": (400, "bad_format"), "?format=onnx&artefact=weights": (400, "bad_artefact"),
        "?format=onnx&artefact=merged": (404, "not_found")}
    assert all(r.json()["error"]["message"].endswith(".") for r in refused.values())
    assert by_carol.status_code == 404


def test_the_job_page_links_the_onnx_download_once_the_job_has_succeeded(customer, mlp_job):
    page = Client()
    page.force_login(customer)
    before = page.get(f"/jobs/{mlp_job}/").content.decode()
    Job.objects.filter(pk=mlp_job).update(status=Job.Status.SUCCEEDED)

    after = page.get(f"/jobs/{mlp_job}/").content.decode()

    assert 'id="download-onnx"' not in before
    assert f'id="download-onnx" href="/api/jobs/{mlp_job}/model?format=onnx"' in after


@pytest.mark.django_db
def test_a_lora_job_exports_only_its_merged_transformer(customer_api):
    base_config = {"vocab_size": 256, "context": 16, "d_model": 16, "layers": 1, "heads": 1}
    base = zoo.init_state("transformer", base_config, seed=1)
    base_id = customer_api.post("/api/datasets", {"file": named_file(tensors.state_dict_to_bytes(base),
                                                                      "base.safetensors")}, format="multipart")
    text = customer_api.post("/api/datasets", {"file": named_file(b"the cat sat on the mat. " * 40, "t.txt"),
                                               "tokenizer": "byte"}, format="multipart")
    job = customer_api.post("/api/jobs", {"dataset": text.json()["id"], "template": "lora", "rounds": 1,
                                          "base_weights": base_id.json()["id"], "hparams": {"rank": 2}},
                            format="json").json()
    adapters = {k: torch.randn_like(v) * 0.1 for k, v in zoo.init_state("lora", Job.objects.get(
        pk=job["id"]).model_config, seed=2).items()}  # trained adapters: B no longer zero
    trained_sha = storage.blob_put(tensors.state_dict_to_bytes(adapters))
    Job.objects.filter(pk=job["id"]).update(status=Job.Status.SUCCEEDED, global_weights_sha256=trained_sha)

    alone = customer_api.get(f"/api/jobs/{job['id']}/model?format=onnx")
    response, model = onnx_of(customer_api, job["id"], "&artefact=merged")

    assert alone.status_code == 400 and alone.json()["error"]["code"] == "not_exportable"
    assert "artefact=merged" in alone.json()["error"]["message"]
    assert response["Content-Disposition"].endswith(f'muninn-job-{job["id"]}-lora-merged.onnx"')
    config = Job.objects.get(pk=job["id"]).model_config  # the base's shapes; heads as the site reads them
    merged = zoo.merge_lora(config, base, adapters)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert_agrees(model, torch_model("transformer", {k: config[k] for k in base_config}, merged), ids)
