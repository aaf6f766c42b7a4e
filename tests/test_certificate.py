"""The training certificate: a real job run to success with simulated devices, its certificate from the API, and the
offline check (`muninn-worker verify-certificate`) passing on it and failing, with one sentence, on anything changed."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from muninn_worker import certificate, signing
from muninn_worker.cli import main as worker_cli
from rest_framework.test import APIClient

from accounts import services as accounts
from accounts.models import User
from contributors import reputation
from contributors.selectors import device_pseudonym
from jobs import services as jobs
from jobs.models import Job, WorkUnit
from muninn import site_key

from .conftest import digits_npz, named_file
from .test_peer_checks import _drain, _submit, gpu_market  # noqa: F401  (a fixture)
from .test_spine import create_job, run_until_done

pytestmark = pytest.mark.django_db(transaction=True)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _site_key_in_tmp(settings, tmp_path):
    """No key configured: the site makes one under its MUNINN_VAR_DIR, as `make run` does."""
    settings.VAR_DIR = tmp_path / "var"
    settings.MUNINN_SIGNING_KEY = settings.MUNINN_SIGNING_KEY_FILE = ""


@pytest.fixture
def succeeded(customer_api, make_device) -> Job:
    dataset = customer_api.post("/api/datasets", {"file": named_file(digits_npz(400), "digits.npz")},
                                format="multipart")
    # both online when round 1 is planned: two units in round 1; round 2's shards are sized by the speeds measured
    # in round 1, so a device the clock found far slower (a loaded machine) may get none (as in test_spine)
    devices = [make_device("a"), make_device("b")]
    job = create_job(customer_api, dataset.json()["id"], rounds=2)
    done = run_until_done(devices, job["id"])
    assert done.status == Job.Status.SUCCEEDED
    return done


def _download(api, job: Job, tmp_path: Path) -> tuple[Path, Path, Path]:
    """The certificate, the model and the site's published key, saved as a customer would."""
    cert = api.get(f"/api/jobs/{job.pk}/certificate")
    assert cert.status_code == 200, cert.content
    assert cert["Content-Disposition"] == f'attachment; filename="muninn-job-{job.pk}-certificate.json"'
    model = api.get(f"/api/jobs/{job.pk}/model")
    key = APIClient().get("/.well-known/muninn-signing-key")
    paths = tmp_path / "cert.json", tmp_path / "model.safetensors", tmp_path / "key.json"
    for path, content in zip(paths, (cert.content, b"".join(model.streaming_content), key.content)):
        path.write_bytes(content)
    return paths


def _verify(capsys, cert: Path, model: Path, key: str | Path) -> tuple[int, str, str]:
    code = worker_cli(["verify-certificate", str(cert), str(model), "--key", str(key)])
    out, err = capsys.readouterr()
    return code, out, err


def _fails(result: tuple[int, str, str], *words: str) -> None:
    """verify-certificate failed with exit 1 and one sentence holding these words."""
    code, _, err = result
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert all(word in err for word in words), err


def test_a_succeeded_jobs_certificate_chains_its_rounds_to_the_model_and_verifies_offline(
        succeeded, customer_api, contributor, tmp_path, capsys):
    cert_path, model_path, key_path = _download(customer_api, succeeded, tmp_path)

    code, out, err = _verify(capsys, cert_path, model_path, key_path)

    assert code == 0, err
    assert out.startswith(f"certificate OK: job {succeeded.pk} (mlp)") and "2 round(s) chained" in out
    document = json.loads(cert_path.read_bytes())
    body = document["certificate"]
    assert cert_path.read_bytes() == certificate.canonical(document)  # served canonical: sorted keys, no spaces
    rounds = list(succeeded.round_set.order_by("number"))
    assert [(r["weights_before_sha256"], r["weights_after_sha256"]) for r in body["rounds"]] == [
        (r.weights_sha256, r.result_sha256) for r in rounds]
    assert body["initial_weights_sha256"] == rounds[0].weights_sha256
    assert body["model"]["final_weights_sha256"] == succeeded.global_weights_sha256 == rounds[-1].result_sha256
    assert body["model"]["file_sha256"] == hashlib.sha256(model_path.read_bytes()).hexdigest()
    assert body["dataset"]["sha256"] == succeeded.dataset.sha256 and body["dataset"]["profile"]["rows"] == 400
    assert body["job"]["hparams"] == succeeded.hparams and body["job"]["aggregation"] == "fedavg"
    # every update: a pseudonymous device, its receipt and output, and a segment re-trained by the site's validator
    units = [u for r in body["rounds"] for u in r["units"]]
    assert [len(r["units"]) for r in body["rounds"]] == [r.metrics["units"] for r in rounds]
    assert len(body["rounds"][0]["units"]) == 2 and all(u["in_model"] for u in units)
    devices = {d.pk for d in contributor.devices.all()}
    assert {u["device"] for u in units} == {device_pseudonym(d) for d in devices}
    named = json.dumps(body)
    assert contributor.username not in named and all(f'"device": {d},' not in named for d in devices)
    for unit in units:
        stored = WorkUnit.objects.get(pk=unit["unit"]).receipts.get(status="accepted")
        assert unit["receipt_sha256"] == hashlib.sha256(certificate.canonical(stored.payload)).hexdigest()
        assert unit["output_sha256"] == stored.output_sha256 and unit["steps"] == stored.steps
        assert unit["verification"]["method"] == "site_reexecution" and unit["verification"]["retrained_steps"] > 0
    checked = body["verification"]
    assert checked["trained_steps"] == sum(u["steps"] for u in units)
    assert checked["retrained_steps"] == sum(u["verification"]["retrained_steps"] for u in units)
    assert 0 < checked["retrained_share"] <= 1 and checked["site_reexecution"] == len(units)
    charges = customer_api.get(f"/api/jobs/{succeeded.pk}/charges").json()
    assert body["money"]["hu_quoted"] == charges["hu_estimated"]
    assert body["money"]["hu_charged"] == charges["hu_charged"]
    assert body["money"]["charged_nanos"] == charges["charged"]["nanos"] > 0


def test_the_certificate_verifies_from_the_command_line(succeeded, customer_api, tmp_path):
    cert_path, model_path, key_path = _download(customer_api, succeeded, tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "worker_client"), os.environ.get("PYTHONPATH", "")])}

    done = subprocess.run([sys.executable, "-m", "muninn_worker", "verify-certificate", str(cert_path),
                           str(model_path), "--key", str(key_path)], capture_output=True, text=True, env=env,
                          timeout=120)

    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"certificate OK: job {succeeded.pk}")


def test_a_changed_field_a_changed_model_and_a_wrong_key_or_signature_each_fail_saying_which(
        succeeded, customer_api, tmp_path, capsys):
    cert_path, model_path, key_path = _download(customer_api, succeeded, tmp_path)
    document = json.loads(cert_path.read_bytes())
    tampered = tmp_path / "tampered.json"

    document["certificate"]["money"]["hu_charged"] = "0"
    tampered.write_bytes(certificate.canonical(document))
    _fails(_verify(capsys, tampered, model_path, key_path), "signature", "changed")

    model = bytearray(model_path.read_bytes())
    model[-1] ^= 1  # one bit of the last tensor
    (tmp_path / "tampered.safetensors").write_bytes(bytes(model))
    _fails(_verify(capsys, cert_path, tmp_path / "tampered.safetensors", key_path),
           "model file's sha256", "not the certified model")

    other_key = signing.public_key_of(signing.new_private_key())
    _fails(_verify(capsys, cert_path, model_path, other_key), "another key")

    original = json.loads(cert_path.read_bytes())
    original["signature"] = signing.sign(signing.new_private_key(), certificate.canonical(original["certificate"]))
    tampered.write_bytes(certificate.canonical(original))
    _fails(_verify(capsys, tampered, model_path, key_path), "signature does not verify")


def test_a_peer_checked_update_names_its_peers(gpu_market, customer_api, tmp_path, capsys):  # noqa: F811
    trained, (peer, _), job = gpu_market
    _submit(trained)
    _drain(peer)
    done = Job.objects.get(pk=job["id"])
    assert done.status == Job.Status.SUCCEEDED
    cert_path, model_path, key_path = _download(customer_api, done, tmp_path)

    code, out, err = _verify(capsys, cert_path, model_path, key_path)

    assert code == 0, err
    assert "0 re-trained in part by the site's validator, 1 by peer devices" in out
    [unit] = json.loads(cert_path.read_bytes())["certificate"]["rounds"][0]["units"]
    assert unit["device"] == device_pseudonym(trained.device.pk)
    assert unit["verification"]["method"] == "peer_check" and unit["verification"]["retrained_steps"] > 0
    assert unit["verification"]["peers"] == [device_pseudonym(peer.device.pk)]


def test_updates_accepted_on_cheap_checks_alone_say_so_and_count_nothing_re_trained(
        customer_api, make_device, settings, monkeypatch, tmp_path, capsys):
    settings.MUNINN_MIN_CHECK_RATE = reputation.ADAPTIVE_MIN_RATE  # an operator lowered the floor
    monkeypatch.setattr(reputation, "should_reexecute", lambda streak, draw, **floor: False)
    dataset = customer_api.post("/api/datasets", {"file": named_file(digits_npz(200), "digits.npz")},
                                format="multipart")
    device = make_device()
    done = run_until_done([device], create_job(customer_api, dataset.json()["id"], rounds=1)["id"])
    cert_path, model_path, key_path = _download(customer_api, done, tmp_path)

    code, out, err = _verify(capsys, cert_path, model_path, key_path)

    assert code == 0, err
    assert "1 on cheap checks only; 0 of" in out and "(0.0%)" in out
    body = json.loads(cert_path.read_bytes())["certificate"]
    assert body["rounds"][0]["units"][0]["verification"] == {"method": "cheap_checks", "segments": [],
                                                            "retrained_steps": 0}
    assert body["verification"]["retrained_share"] == 0 and body["verification"]["cheap_checks"] == 1


def test_a_broken_weights_chain_fails_even_when_signed(succeeded, customer_api, tmp_path, capsys):
    cert_path, model_path, key_path = _download(customer_api, succeeded, tmp_path)
    body = json.loads(cert_path.read_bytes())["certificate"]
    body["rounds"][1]["weights_before_sha256"] = "0" * 64  # as a site bug would state it, signed all the same
    (tmp_path / "broken.json").write_bytes(certificate.canonical(certificate.sign(body, site_key.private_key())))

    result = _verify(capsys, tmp_path / "broken.json", model_path, key_path)

    _fails(result, "weights chain breaks at round 2", "round 1's weights after")


def test_an_update_flagged_after_the_fact_is_listed_in_its_round_and_marked_in_the_model(
        succeeded, customer_api, tmp_path, capsys):
    before_cert, before_model, key_path = _download(customer_api, succeeded, tmp_path)
    unit = WorkUnit.objects.filter(round__job=succeeded, round__number=1).first()

    jobs.units_flag(unit_ids=[unit.pk], reason="its device failed a check on another job")
    later = tmp_path / "later"
    later.mkdir()
    cert_path, model_path, _ = _download(customer_api, succeeded, later)

    body = json.loads(cert_path.read_bytes())["certificate"]
    assert body["rounds"][0]["flagged"] == [{"unit": unit.pk, "reason": "its device failed a check on another job",
                                             "in_model": True}]
    assert body["rounds"][1]["flagged"] == [] and body["model"]["flagged_rounds"] == [1]
    code, out, err = _verify(capsys, cert_path, model_path, key_path)
    assert code == 0, err
    assert "1 update(s) flagged after the fact" in out
    # the model downloaded before carries no flag: its weights are the certified ones, its metadata is not
    _fails(_verify(capsys, cert_path, before_model, key_path), "metadata differs")


def test_an_update_whose_check_passed_after_its_round_closed_is_listed_but_not_in_the_model(
        customer_api, make_device, tmp_path, capsys):
    dataset = customer_api.post("/api/datasets", {"file": named_file(digits_npz(200), "digits.npz")},
                                format="multipart")
    prompt, late = make_device("prompt"), make_device("late", answer=False)
    job = create_job(customer_api, dataset.json()["id"], rounds=1)
    assert prompt.work_one()
    unit = late.claim()
    challenge = late.submit(unit["id"], *late.train(unit)).json()["challenge"]  # checked once its checkpoints come
    rnd = WorkUnit.objects.get(pk=unit["id"]).round
    jobs.round_aggregate(round_id=rnd.pk)  # the round's deadline: it closes with the one verified update

    late.answer_challenge(challenge)  # the check passes now: credited, but the round was combined without it
    jobs.units_flag(unit_ids=[unit["id"]], reason="its device failed a check on another job")
    done = Job.objects.get(pk=job["id"])
    cert_path, model_path, key_path = _download(customer_api, done, tmp_path)

    assert WorkUnit.objects.get(pk=unit["id"]).status == WorkUnit.Status.ACCEPTED
    body = json.loads(cert_path.read_bytes())["certificate"]
    combined = WorkUnit.objects.get(round=rnd, receipts__device=prompt.device)
    assert {u["unit"]: u["in_model"] for u in body["rounds"][0]["units"]} == {unit["id"]: False, combined.pk: True}
    assert body["rounds"][0]["flagged"][0]["in_model"] is False and body["model"]["flagged_rounds"] == []
    assert body["verification"]["updates"] == 1
    assert _verify(capsys, cert_path, model_path, key_path)[0] == 0


def test_the_model_download_is_the_same_bytes_every_time(succeeded, customer_api):
    downloads = {b"".join(customer_api.get(f"/api/jobs/{succeeded.pk}/model").streaming_content) for _ in range(5)}

    assert len(downloads) == 1


def test_another_customers_certificate_is_not_found_and_an_unfinished_jobs_is_a_conflict(
        succeeded, customer_api, staff, make_device):
    other = accounts.user_create(username="carol", password="carol-pass-123", role=User.Role.CUSTOMER)
    carol = APIClient()
    carol.credentials(HTTP_AUTHORIZATION=f"Token {accounts.token_for(user=other)}")
    running = create_job(customer_api, succeeded.dataset_id, rounds=2)

    assert carol.get(f"/api/jobs/{succeeded.pk}/certificate").status_code == 404
    assert APIClient().get(f"/api/jobs/{succeeded.pk}/certificate").status_code in (401, 403)
    refused = customer_api.get(f"/api/jobs/{running['id']}/certificate")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_ready"


def test_the_job_page_links_the_certificate_next_to_the_model(succeeded, customer, client):
    client.force_login(customer)

    page = client.get(f"/jobs/{succeeded.pk}/").content.decode()

    assert f'href="/api/jobs/{succeeded.pk}/model"' in page
    assert f'id="download-certificate" href="/api/jobs/{succeeded.pk}/certificate"' in page


def test_the_published_key_is_public_cacheable_and_verifies_the_certificate(succeeded, customer_api):
    published = APIClient().get("/.well-known/muninn-signing-key")
    document = json.loads(customer_api.get(f"/api/jobs/{succeeded.pk}/certificate").content)

    assert published.status_code == 200 and published["Content-Type"] == "application/json"
    assert "public" in published["Cache-Control"] and "max-age" in published["Cache-Control"]
    key = published.json()
    assert key["algorithm"] == "Ed25519" and key["key"] == document["key"]
    assert signing.verify(key["key"], certificate.canonical(document["certificate"]), document["signature"])
    assert certificate.public_key_from(published.content.decode()) == key["key"]


def test_the_site_key_is_made_once_and_kept_across_restarts(settings, tmp_path):
    first = site_key.public_key()
    key_file = settings.VAR_DIR / "signing-key"
    site_key._LOADED.clear()  # a restart: nothing in memory, the file on disk

    assert site_key.public_key() == first
    assert key_file.stat().st_mode & 0o777 == 0o600
    configured = signing.new_private_key()
    settings.MUNINN_SIGNING_KEY = configured
    assert site_key.public_key() == signing.public_key_of(configured)
    settings.MUNINN_SIGNING_KEY, settings.MUNINN_SIGNING_KEY_FILE = "", str(tmp_path / "named-key")
    (tmp_path / "named-key").write_text(configured + "\n")
    assert site_key.public_key() == signing.public_key_of(configured)
