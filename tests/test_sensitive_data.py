"""Data exposure tiers: a dataset marked sensitive goes only to devices that meet the trust level staff set, every
shard a device downloads is recorded and shown on the job page, a job no trusted device can run says so, and its
data is sealed at rest under a key of its own (jobs/sealing.py)."""
from __future__ import annotations

import hashlib
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from accounts import services as accounts
from accounts.models import User
from contributors import exposure
from contributors.models import Device, ExposurePolicy, PeerCheck, Receipt, ShardDownload
from contributors.selectors import capacity_for
from jobs import sealing, storage
from jobs import selectors as job_selectors
from jobs import services as jobs
from jobs.models import Dataset, Job, WorkUnit

from .conftest import SimulatedDevice, digits_npz, named_file
from .test_spine import create_job, run_until_done

pytestmark = pytest.mark.django_db(transaction=True)

POLICY = exposure.TrustPolicy(min_verified_units=20, min_device_age_days=7)


def upload(api, *, sensitive, rows: int | None = None) -> dict:
    response = api.post("/api/datasets", {"file": named_file(digits_npz(rows), "digits.npz"),
                                          "sensitive": sensitive}, format="multipart")
    assert response.status_code == 201, response.content
    return response.json()


def make_trusted(*devices: SimulatedDevice) -> None:
    """A record that meets the default policy: 50 verified results, registered 30 days ago. No speed on record
    (0): with the registration's 1,000 samples/s as its record, a fast machine trains these small units "implausibly
    fast", which draws a second challenged segment (a second peer check) that these tests do not expect."""
    Device.objects.filter(pk__in=[d.device.pk for d in devices]).update(
        verified_total=50, verified_streak=50, created_at=timezone.now() - timedelta(days=30), samples_per_s=0.0)


def claimed_unit(device: SimulatedDevice) -> WorkUnit | None:
    response = device.client.post("/api/worker/claim", {}, format="json")
    assert response.status_code in (200, 204), response.content
    return None if response.status_code == 204 else WorkUnit.objects.get(pk=response.json()["unit"]["id"])


def device_like(**fields) -> SimpleNamespace:
    base = {"is_active": True, "quarantined_at": None, "failures": 0, "owner_flagged": False, "verified_total": 30,
            "created_at": timezone.now() - timedelta(days=10), "owner_id": 7}
    return SimpleNamespace(**{**base, **fields})


# --- The trust rule -----------------------------------------------------------------------------------------

def test_device_trusted_needs_a_verified_record_an_age_good_standing_and_an_approved_owner_when_asked():
    now = timezone.now()
    assert exposure.device_trusted(device_like(), POLICY, now)
    assert not exposure.device_trusted(device_like(verified_total=19), POLICY, now)
    assert not exposure.device_trusted(device_like(created_at=now - timedelta(days=6, hours=23)), POLICY, now)
    assert not exposure.device_trusted(device_like(quarantined_at=now), POLICY, now)
    assert not exposure.device_trusted(device_like(failures=1), POLICY, now)
    assert not exposure.device_trusted(device_like(owner_flagged=True), POLICY, now)
    assert not exposure.device_trusted(device_like(is_active=False), POLICY, now)
    approved = exposure.TrustPolicy(20, 7, require_approved_owner=True, approved_owner_ids=frozenset({7}))
    assert exposure.device_trusted(device_like(owner_id=7), approved, now)
    assert not exposure.device_trusted(device_like(owner_id=8), approved, now)
    assert exposure.policy_words(approved) == (
        "devices with at least 20 verified results, registered at least 7 days ago in good standing (never "
        "quarantined since their last review, no failed check on record), whose owner staff approved for sensitive "
        "data")


# --- Routing ------------------------------------------------------------------------------------------------

def test_a_sensitive_jobs_units_go_only_to_trusted_devices_and_the_untrusted_get_other_work(
        customer_api, make_device):
    sensitive = create_job(customer_api, upload(customer_api, sensitive="true", rows=300)["id"], rounds=1)
    plain = create_job(customer_api, upload(customer_api, sensitive="false", rows=300)["id"], rounds=1)
    newcomer, veteran = make_device("new"), make_device("veteran")
    make_trusted(veteran)

    first, second = claimed_unit(newcomer), claimed_unit(newcomer)
    trusted = claimed_unit(veteran)

    assert first.round.job_id == plain["id"]  # the untrusted device still gets the work it may see
    assert second is None  # the sensitive unit was queued all along, yet not for it
    assert trusted.round.job_id == sensitive["id"]
    assert WorkUnit.objects.get(round__job_id=sensitive["id"]).leased_device_id == veteran.device.pk


def test_staff_may_require_an_approved_owner(customer_api, make_device, contributor):
    create_job(customer_api, upload(customer_api, sensitive=True, rows=300)["id"], rounds=1)
    device = make_device()
    make_trusted(device)
    policy, _ = ExposurePolicy.objects.update_or_create(pk=1, defaults={"require_approved_owner": True})

    assert claimed_unit(device) is None  # a record and an age, but its owner is not approved

    policy.approved_owners.add(contributor)  # staff approve bob in the admin (the change is seen at once)
    assert claimed_unit(device) is not None


def test_a_due_policy_is_read_by_one_thread_while_the_others_go_on_with_the_last_one(monkeypatch):
    monkeypatch.setattr(exposure, "POLICY_TTL_S", 0.0)  # every read is due at once
    ExposurePolicy.objects.update_or_create(pk=1, defaults={"min_verified_units": 7})
    assert exposure.policy_current().min_verified_units == 7
    ExposurePolicy.objects.filter(pk=1).update(min_verified_units=9)  # another process's change: no signal here

    with exposure._policy_lock, CaptureQueriesContext(connection) as reading:  # another thread is reading it
        assert exposure.policy_current().min_verified_units == 7
        assert len(reading) == 0
    with CaptureQueriesContext(connection) as reading:  # nobody is: this thread reads it
        assert exposure.policy_current().min_verified_units == 9
        assert len(reading) > 0
    exposure.policy_forget()  # forgotten (a save in this process): the next claim waits for a fresh read
    ExposurePolicy.objects.filter(pk=1).update(min_verified_units=11)
    assert exposure.policy_current().min_verified_units == 11


def test_a_sensitive_rounds_shards_are_sized_for_trusted_devices_only(customer_api, make_device):
    newcomer, veteran = make_device("new"), make_device("veteran")
    make_trusted(veteran)

    job = create_job(customer_api, upload(customer_api, sensitive=True, rows=300)["id"], rounds=1)

    units = list(WorkUnit.objects.filter(round__job_id=job["id"]))
    assert [u.preferred_device_id for u in units] == [veteran.device.pk]  # one shard, none reserved for the new one
    assert claimed_unit(newcomer) is None


def test_a_sensitive_job_with_no_trusted_device_online_says_so_and_its_wait_clock_runs(customer_api, make_device):
    job = create_job(customer_api, upload(customer_api, sensitive=True, rows=300)["id"], rounds=1)
    device = make_device()

    waiting = customer_api.get(f"/api/jobs/{job['id']}").json()["waiting"]
    jobs.jobs_check_waiting(capacity_for=capacity_for)

    assert waiting.startswith("No trusted device is online: this dataset is marked sensitive, so its shards go only "
                              "to devices with at least 20 verified results, registered at least 7 days ago")
    assert "1 online device(s) could run this job but do not meet that yet" in waiting
    assert Job.objects.get(pk=job["id"]).waiting_since is not None
    make_trusted(device)
    assert customer_api.get(f"/api/jobs/{job['id']}").json()["waiting"] is None
    jobs.jobs_check_waiting(capacity_for=capacity_for)
    assert Job.objects.get(pk=job["id"]).waiting_since is None


def test_a_plain_job_does_not_wait_for_trust(customer_api, make_device):
    job = create_job(customer_api, upload(customer_api, sensitive=False, rows=300)["id"], rounds=1)
    make_device()

    assert customer_api.get(f"/api/jobs/{job['id']}").json()["waiting"] is None


def test_peer_checks_of_sensitive_data_go_only_to_trusted_peers_and_are_logged(customer_api, make_device, settings):
    settings.MUNINN_VALIDATOR_BACKENDS = []  # no validator of the site runs CPU segments: a peer device must
    job = create_job(customer_api, upload(customer_api, sensitive=True, rows=300)["id"], rounds=1)
    trainer = make_device("trainer")
    peers = [SimulatedDevice(accounts.user_create(username=f"peer{i}", password="peer-pass-123",
                                                  role=User.Role.CONTRIBUTOR), f"peer-{i}") for i in (1, 2)]
    make_trusted(trainer, peers[1])
    Device.objects.filter(pk=peers[0].device.pk).update(verified_total=50, verified_streak=50)  # a record, no age
    assert trainer.work_one()
    receipt = Receipt.objects.get(device=trainer.device)
    assert receipt.status == Receipt.Status.PENDING and receipt.peer_checks.count() == 1

    young = peers[0].client.post("/api/worker/claim", {}, format="json")
    assert young.status_code == 204  # a streak long enough for peer checks, but not trusted with sensitive rows
    assert peers[1].claim() is None  # ran the check on the way (SimulatedDevice.claim)

    check = PeerCheck.objects.get(receipt=receipt)
    assert check.device_id == peers[1].device.pk and check.status == PeerCheck.Status.AGREED
    receipt.refresh_from_db()
    assert receipt.status == Receipt.Status.ACCEPTED
    logged = ShardDownload.objects.get(peer_check=check)
    assert (logged.device_id, logged.owner.username, logged.unit_id) == (peers[1].device.pk, "peer2", receipt.unit_id)
    assert Job.objects.get(pk=job["id"]).status == Job.Status.SUCCEEDED


def test_a_device_that_lost_its_standing_since_its_lease_gets_no_sensitive_shard(customer_api, make_device):
    create_job(customer_api, upload(customer_api, sensitive=True, rows=300)["id"], rounds=1)
    device = make_device()
    make_trusted(device)
    unit = claimed_unit(device)
    Device.objects.filter(pk=device.device.pk).update(failures=1)  # a failure confirmed on other work meanwhile

    response = device.client.get(f"/api/worker/units/{unit.pk}/shard")

    assert response.status_code == 403
    assert response.json()["error"]["code"] == "not_trusted"
    assert not ShardDownload.objects.exists()


# --- The whole job: trained, logged, sealed -------------------------------------------------------------------

def test_a_sensitive_job_trains_on_trusted_devices_with_every_download_logged_and_no_plaintext_at_rest(
        customer, customer_api, make_device, settings):
    raw = digits_npz()
    dataset = customer_api.post("/api/datasets", {"file": named_file(raw, "digits.npz"), "sensitive": "on"},
                                format="multipart").json()
    devices = [make_device("a"), make_device("b")]
    make_trusted(*devices)
    job = create_job(customer_api, dataset["id"], rounds=3)

    done = run_until_done(devices, job["id"])

    assert done.status == Job.Status.SUCCEEDED
    assert done.round_set.order_by("number").last().metrics["test_accuracy"] >= 0.85
    units = WorkUnit.objects.filter(round__job=done, receipts__isnull=False).distinct()
    logged = sorted(ShardDownload.objects.filter(job=done).values_list("unit_id", "device_id", "shard_start",
                                                                       "shard_stop"))
    assert logged == sorted((u.pk, u.leased_device_id, u.shard_start, u.shard_stop) for u in units)
    assert len(logged) == 6  # two devices, three rounds: every download, with the rows it held
    # At rest: the upload, the splits and every shard are sealed; no file under MEDIA_ROOT is any of them in plain.
    plain = {dataset["sha256"], done.train_sha256, done.test_sha256, *units.values_list("shard_sha256", flat=True)}
    files = [p for p in Path(settings.MEDIA_ROOT).rglob("*") if p.is_file()]
    at_rest = {hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    assert not plain & at_rest
    assert not plain & {p.name for p in files}  # nor named by their hashes
    assert not any(raw[1000:1064] in p.read_bytes() for p in files)
    assert len([p for p in files if "sealed" in p.parts]) >= len(plain)
    # The site itself reads them through the dataset's key (here: the held-out evaluation above, and this).
    key = job_selectors.job_data_key(done)
    assert storage.data_get(done.test_sha256, key=key)[:8] != b""
    with pytest.raises(FileNotFoundError):
        storage.blob_get(done.train_sha256)


def test_the_job_page_and_api_show_the_download_log_to_its_customer_only(customer, customer_api, make_device, staff):
    job = create_job(customer_api, upload(customer_api, sensitive=True, rows=300)["id"], rounds=1)
    device = make_device()
    make_trusted(device)
    assert device.work_one()
    unit = WorkUnit.objects.get(round__job_id=job["id"])
    page = Client()
    page.force_login(customer)

    body = page.get(f"/jobs/{job['id']}/").content.decode()
    answer = customer_api.get(f"/api/jobs/{job['id']}/shard-downloads").json()

    assert "Shard downloads" in body and f"#{device.device.pk}" in body and "bob" in body
    assert f"{unit.shard_start}–{unit.shard_stop - 1}" in body
    assert answer["sensitive"] is True and answer["count"] == 1
    assert answer["downloads"][0] | {"at": None} == {
        "at": None, "device": device.device.pk, "owner": "bob", "round": 1, "unit": unit.pk, "check": None,
        "shard_start": unit.shard_start, "shard_stop": unit.shard_stop}
    stranger = accounts.user_create(username="mallory", password="mallory-pass-123", role=User.Role.CUSTOMER)
    intruder = Client()
    intruder.force_login(stranger)
    assert intruder.get(f"/jobs/{job['id']}/").status_code == 404
    other_api = customer_api.__class__()
    other_api.credentials(HTTP_AUTHORIZATION=f"Token {accounts.token_for(user=stranger)}")
    assert other_api.get(f"/api/jobs/{job['id']}/shard-downloads").status_code == 404


def test_a_plain_jobs_downloads_are_not_logged_and_its_page_has_no_log(customer, customer_api, make_device):
    job = create_job(customer_api, upload(customer_api, sensitive=False, rows=300)["id"], rounds=1)
    assert make_device().work_one()
    page = Client()
    page.force_login(customer)

    assert not ShardDownload.objects.exists()
    assert "Shard downloads" not in page.get(f"/jobs/{job['id']}/").content.decode()
    assert customer_api.get(f"/api/jobs/{job['id']}/shard-downloads").json()["count"] == 0


# --- Upload, keys and bad input -------------------------------------------------------------------------------

def test_the_upload_form_marks_a_dataset_sensitive_and_its_page_says_so(customer):
    page = Client()
    page.force_login(customer)

    response = page.post("/datasets/", {"file": named_file(digits_npz(100), "d.npz"), "sensitive": "on"})

    dataset = Dataset.objects.get()
    assert response.status_code == 302 and dataset.sensitive
    assert "Sensitive." in page.get(f"/datasets/{dataset.pk}/").content.decode()


def test_a_sensitive_datasets_key_is_kept_wrapped_and_opens_only_with_the_sites_data_key(customer_api, settings):
    dataset = Dataset.objects.get(pk=upload(customer_api, sensitive=True, rows=100)["id"])
    key = job_selectors.dataset_key(dataset)

    assert len(key) == 32 and key not in bytes(dataset.wrapped_key)
    assert storage.data_get(dataset.sha256, key=key) == digits_npz(100)
    settings.MUNINN_DATA_KEY = "A" * 43 + "="  # another site key: nothing opens
    with pytest.raises(sealing.SealError):
        job_selectors.dataset_key(dataset)


def test_a_sealed_blob_changed_in_storage_does_not_open():
    key = sealing.new_dataset_key()
    sha = hashlib.sha256(b"rows").hexdigest()
    sealed = sealing.seal(b"rows", key, sha256=sha)

    assert sealing.unseal(sealed, key, sha256=sha) == b"rows"
    with pytest.raises(sealing.SealError):
        sealing.unseal(sealed[:-1] + bytes([sealed[-1] ^ 1]), key, sha256=sha)
    with pytest.raises(sealing.SealError):
        sealing.unseal(sealed, sealing.new_dataset_key(), sha256=sha)


@pytest.mark.parametrize("value", ["maybe", "2", "sensitive"])
def test_a_bad_sensitive_value_is_refused(customer_api, value):
    response = customer_api.post("/api/datasets", {"file": named_file(digits_npz(100), "d.npz"), "sensitive": value},
                                 format="multipart")

    assert response.status_code == 400
    assert "sensitive" in str(response.json()["error"])
    assert not Dataset.objects.exists()


def test_base_weights_cannot_be_marked_sensitive(customer_api):
    from muninn_worker import tensors, zoo

    config = {"vocab_size": 256, "context": 16, "d_model": 16, "layers": 1, "heads": 1}
    weights = tensors.state_dict_to_bytes(zoo.init_state("transformer", config, seed=1))
    response = customer_api.post("/api/datasets", {"file": named_file(weights, "base.safetensors"),
                                                   "sensitive": True}, format="multipart")

    assert response.status_code == 400
    assert response.json()["error"]["code"] == "sensitive_weights"
    assert not Dataset.objects.exists()


def test_a_shard_the_site_cannot_open_is_a_503_not_served_nor_logged(customer_api, make_device, settings):
    create_job(customer_api, upload(customer_api, sensitive=True, rows=300)["id"], rounds=1)
    device = make_device()
    make_trusted(device)
    unit = claimed_unit(device)
    settings.MUNINN_DATA_KEY = "A" * 43 + "="  # the operator changed the site's data key: no dataset key opens

    response = device.client.get(f"/api/worker/units/{unit.pk}/shard")

    assert response.status_code == 503, response.content
    error = response.json()["error"]
    assert error["code"] == "data_unreadable" and "MUNINN_DATA_KEY" in error["message"]
    assert not ShardDownload.objects.exists()
    assert not Device.objects.get(pk=device.device.pk).events.exists()  # not the device's fault
