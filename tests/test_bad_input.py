"""Input from outside (uploads, API calls, worker results) gets a clear 4xx and changes nothing."""
from __future__ import annotations

import io
import json
import pickle

import pytest
import torch
import zlib

from muninn_worker import codec, signing, tensors

from billing.models import Entry, Transaction
from contributors.models import Receipt
from jobs.models import Dataset, Job, WorkUnit

from .conftest import named_file

pytestmark = pytest.mark.django_db(transaction=True)


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and {"code", "message", "detail"} <= set(body["error"]), body
    return body["error"]


@pytest.mark.parametrize("name, data, code", [
    ("notes.txt", b"just some words\nnot a table\n", "too_few_rows"),  # text, but too little to learn from
    ("photos.zip", b"PK\x03\x04 broken", "unknown_format"),
    ("model.npz", pickle.dumps({"X": [1, 2, 3]}), "pickle_rejected"),
    ("data.csv", b"a,b,label\n1,2,x\n3,oops,y\n", "bad_number"),
    ("empty.csv", b"", "empty_file"),
])
def test_unsupported_or_broken_upload_is_refused_and_nothing_is_stored(customer_api, settings, name, data, code):
    response = customer_api.post("/api/datasets", {"file": named_file(data, name)}, format="multipart")

    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == code and error["message"]
    assert not Dataset.objects.exists()


def test_upload_over_the_size_limit_is_refused(customer_api, settings):
    settings.MUNINN_MAX_UPLOAD_BYTES = 100
    response = customer_api.post("/api/datasets", {"file": named_file(b"a,b\n" + b"1,2\n" * 100, "big.csv")},
                                 format="multipart")
    assert response.status_code == 413
    assert not Dataset.objects.exists()


def test_bad_hyper_parameters_name_the_field(customer_api, digits_dataset):
    response = customer_api.post("/api/jobs", {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 2,
                                               "hparams": {"lr": 1000}}, format="json")
    assert response.status_code == 400
    assert "lr" in error_of(response)["message"]
    assert not Job.objects.exists()


def test_another_customers_dataset_is_not_found(customer_api, digits_dataset, contributor):
    from accounts import services as accounts
    from accounts.models import User
    from rest_framework.test import APIClient

    mallory = accounts.user_create(username="mallory", password="mallory-pass-1", role=User.Role.CUSTOMER)
    other = APIClient()
    other.credentials(HTTP_AUTHORIZATION=f"Token {accounts.token_for(user=mallory)}")
    assert other.get(f"/api/datasets/{digits_dataset['id']}").status_code == 404
    response = other.post("/api/jobs", {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 1},
                          format="json")
    assert response.status_code == 404


@pytest.fixture
def leased(customer_api, digits_dataset, make_device):
    """A running job and a unit leased to one device, trained honestly (weights, receipt) but not uploaded."""
    job = customer_api.post("/api/jobs", {"dataset": digits_dataset["id"], "template": "mlp", "rounds": 2,
                                          "start": True}, format="json").json()
    device = make_device("holder")
    unit = device.claim()
    weights, receipt = device.train(unit)
    return {"job": job, "device": device, "unit": unit, "weights": weights, "receipt": receipt}


def assert_nothing_changed(leased, *, refused: bool = True) -> None:
    """No result, no credit, the job where it was; a refused result sends its unit back to the queue."""
    unit = WorkUnit.objects.get(pk=leased["unit"]["id"])
    assert unit.status == (WorkUnit.Status.QUEUED if refused else WorkUnit.Status.LEASED)
    assert not unit.result_sha256
    assert not Transaction.objects.filter(kind=Transaction.Kind.CHARGE).exists()
    assert not Receipt.objects.filter(status=Receipt.Status.ACCEPTED).exists()
    assert Job.objects.get(pk=leased["job"]["id"]).current_round == 1


def test_result_for_someone_elses_unit_is_refused(leased, make_device):
    intruder = make_device("intruder")

    response = intruder.submit(leased["unit"]["id"], leased["weights"], leased["receipt"])

    assert response.status_code == 409
    assert error_of(response)["code"] == "lease_lost"
    assert intruder.client.get(f"/api/worker/units/{leased['unit']['id']}/weights").status_code == 409
    assert_nothing_changed(leased, refused=False)  # the holder's lease is untouched
    assert "not leased to this device" in intruder.device.events.get(kind="refused").reason


def _with(leased, encoded_change) -> tuple[bytes, dict]:
    """The honest upload with its encoded tensors changed (a broken or lying client), and a matching receipt."""
    encoded = codec.unpack(leased["weights"])
    encoded_change(encoded)
    data = codec.pack(encoded, leased["unit"]["encoding"])
    return data, {**leased["receipt"], "output_sha256": tensors.sha256_hex(data)}


def _first_weight(state) -> str:
    return next(k for k in state if k.endswith("weight"))


@pytest.mark.parametrize("change, code", [
    (lambda s: s.__setitem__(_first_weight(s), torch.zeros(3, 3)), "wrong_shape"),
    # Non-finite values the receipt's chain does not end at: refused as inconsistent. (A non-finite result the
    # chain does end at is re-trained whole, since honest training can diverge: tests/test_verification.py.)
    (lambda s: s[_first_weight(s)].view(-1).__setitem__(0, float("nan")), "chain_mismatch"),
    (lambda s: s[_first_weight(s)].view(-1).__setitem__(0, float("inf")), "chain_mismatch"),
    (lambda s: s.__setitem__(_first_weight(s), s[_first_weight(s)].double()), "wrong_dtype"),
    (lambda s: s.__setitem__("extra.weight", torch.zeros(2)), "wrong_tensors"),
])
def test_result_with_bad_tensors_is_refused(leased, change, code):
    data, receipt = _with(leased, change)

    response = leased["device"].submit(leased["unit"]["id"], data, receipt)

    assert response.status_code == 400
    assert error_of(response)["code"] == code
    assert_nothing_changed(leased)
    assert Receipt.objects.filter(status=Receipt.Status.REJECTED, reason__startswith=code).count() == 1


def test_pickle_posing_as_weights_is_refused(leased):
    payload = pickle.dumps({"w": torch.zeros(2)})
    receipt = {**leased["receipt"], "output_sha256": tensors.sha256_hex(payload)}

    response = leased["device"].submit(leased["unit"]["id"], payload, receipt)

    assert response.status_code == 400
    assert error_of(response)["code"] == "not_safetensors"
    assert_nothing_changed(leased)


@pytest.mark.parametrize("make_upload, code", [
    (lambda leased: zlib.compress(bytes(64 << 20)), "too_large"),  # a deflate bomb: inflates far past the weights
    (lambda leased: zlib.compress(leased["weights"])[:-20], "not_safetensors"),  # truncated
    (lambda leased: zlib.compress(pickle.dumps({"w": torch.zeros(2)})), "not_safetensors"),  # a deflated pickle
])
def test_malformed_or_oversize_encoded_update_is_refused(leased, make_upload, code):
    data = make_upload(leased)
    receipt = {**leased["receipt"], "output_sha256": tensors.sha256_hex(data)}

    response = leased["device"].submit(leased["unit"]["id"], data, receipt)

    assert response.status_code == 400
    assert error_of(response)["code"] == code
    assert_nothing_changed(leased)


def test_update_in_another_encoding_than_the_jobs_is_refused(leased):
    trained = leased["device"].decoded(leased["unit"], leased["weights"])
    data = codec.encode_update(trained, leased["device"].global_state(leased["unit"]), "int8")  # the job says fp32
    receipt = {**leased["receipt"], "output_sha256": tensors.sha256_hex(data)}

    response = leased["device"].submit(leased["unit"]["id"], data, receipt)

    assert response.status_code == 400
    assert error_of(response)["code"] == "wrong_dtype" and "fp32 update" in error_of(response)["message"]
    assert_nothing_changed(leased)


def test_receipt_that_does_not_match_the_upload_is_refused(leased):
    receipt = {**leased["receipt"], "output_sha256": "0" * 64}
    response = leased["device"].submit(leased["unit"]["id"], leased["weights"], receipt)
    assert response.status_code == 400
    assert error_of(response)["code"] == "receipt_output_mismatch"
    assert_nothing_changed(leased)


@pytest.mark.parametrize("variant, code", [
    ("unsigned", "no_signature"), ("garbage", "bad_signature"), ("other_key", "bad_signature"),
    ("re_serialised", "bad_signature"),
])
def test_unsigned_or_forged_receipt_is_refused(leased, make_device, variant, code):
    device, unit_id, receipt = leased["device"], leased["unit"]["id"], leased["receipt"]
    body = json.dumps(receipt)
    signature = {
        "unsigned": "",
        "garbage": "bm90IGEgc2lnbmF0dXJl",
        "other_key": signing.sign(make_device("other").signing_key, body.encode()),
        "re_serialised": signing.sign(device.signing_key, body.encode()),
    }[variant]
    sent = body.replace(", ", ",") if variant == "re_serialised" else body  # same JSON, other bytes

    response = device.client.post(f"/api/worker/units/{unit_id}/result",
                                  {"weights": io.BytesIO(leased["weights"]), "receipt": sent, "signature": signature},
                                  format="multipart")

    assert response.status_code == 400 and error_of(response)["code"] == code
    assert_nothing_changed(leased)


def test_device_registration_needs_a_valid_public_key(contributor):
    from accounts import services as accounts
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {accounts.token_for(user=contributor)}")
    body = {"name": "x", "capabilities": {"cpu_cores": 2, "ram_bytes": 1, "backends": ["cpu"],
                                          "torch_version": "2.13.0"}, "public_key": "not-a-key"}
    response = client.post("/api/worker/devices", body, format="json")
    assert response.status_code == 400 and "public_key" in error_of(response)["message"]
    key = signing.new_private_key()
    assert client.post("/api/worker/devices", {**body, "public_key": signing.public_key_of(key)},
                       format="json").status_code == 201


def test_malformed_receipt_is_refused(leased):
    device, unit_id = leased["device"], leased["unit"]["id"]
    not_json = device.client.post(f"/api/worker/units/{unit_id}/result",
                                  {"weights": io.BytesIO(leased["weights"]), "receipt": "{nope"}, format="multipart")
    missing = device.submit(unit_id, leased["weights"], {k: v for k, v in leased["receipt"].items() if k != "samples"})
    assert not_json.status_code == 400 and error_of(not_json)["code"] == "bad_receipt"
    assert missing.status_code == 400 and "samples" in error_of(missing)["message"]
    assert_nothing_changed(leased, refused=False)  # unreadable requests never reach the checks


def test_worker_api_needs_a_device_token(leased, customer_api):
    assert customer_api.post("/api/worker/claim").status_code in (401, 403)
    from rest_framework.test import APIClient

    anonymous = APIClient()
    anonymous.credentials(HTTP_AUTHORIZATION="Device not-a-real-token")
    assert anonymous.post("/api/worker/claim").status_code == 401
    assert_nothing_changed(leased, refused=False)
    assert Entry.objects.exists()  # the customer's credit and the job's hold are still there


@pytest.mark.parametrize("field, value", [
    ("steps", 10**18), ("samples", 10**18), ("segment_steps", 2**31), ("unit", 10**30),
    ("loss_before", 1e300), ("loss_after", -1e300), ("train_seconds", 1e300), ("steps", -1),
])
def test_receipt_numbers_out_of_range_are_refused_naming_the_field(leased, field, value):
    device, unit_id = leased["device"], leased["unit"]["id"]

    response = device.submit(unit_id, leased["weights"], {**leased["receipt"], field: value})

    assert response.status_code == 400, response.content
    error = error_of(response)
    assert error["code"] == "bad_receipt" and f"receipt.{field}" in error["message"]
    assert not Receipt.objects.exists()  # refused before anything reached the database
    assert_nothing_changed(leased, refused=False)


def test_receipt_steps_other_than_the_units_are_refused(leased):
    device, unit_id = leased["device"], leased["unit"]["id"]

    response = device.submit(unit_id, leased["weights"], {**leased["receipt"], "steps": leased["receipt"]["steps"] + 1})

    assert response.status_code == 400 and error_of(response)["code"] == "receipt_steps_mismatch"
    assert_nothing_changed(leased)


@pytest.mark.parametrize("path", ["units/88069337288156951609344/heartbeat", "units/9223372036854775808/result",
                                  "units/88069337288156951609344/checkpoints/1", "checks/99999999999999999999/start"])
def test_ids_past_a_bigint_are_not_found(leased, path):
    response = leased["device"].client.post(f"/api/worker/{path}", {}, format="json")

    assert response.status_code == 404
    assert_nothing_changed(leased, refused=False)


def test_a_result_far_larger_than_its_units_weights_is_refused_before_it_is_read(leased):
    # 200 MB under the site's 512 MB limit, but an mlp update is tens of kilobytes: refused from the
    # Content-Length alone (the body would fail the test if anything read it).
    class UnreadableBody:
        def read(self, *args):
            raise AssertionError("the body was read")

        readline = read

    response = leased["device"].client.generic(
        "POST", f"/api/worker/units/{leased['unit']['id']}/result", b"",
        content_type="multipart/form-data; boundary=x", CONTENT_LENGTH=str(200 * 2**20),
        **{"wsgi.input": UnreadableBody()})

    assert response.status_code == 413
    error = error_of(response)
    assert error["code"] == "too_large" and f"a result for unit {leased['unit']['id']} is at most" in error["message"]
    assert_nothing_changed(leased, refused=False)
    assert "too_large" in leased["device"].device.events.get(kind="refused").reason
