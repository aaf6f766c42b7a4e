"""Blobs on an S3-compatible bucket: a whole job with every dataset, shard, weight and result going through
django-storages and boto3 to a real S3 endpoint over HTTP (moto's standalone server, started here as a process),
and nothing written to local files (README: "How it scales"; docs/deploy.md)."""
from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
from django.core.files.storage import default_storage

from jobs import services as jobs
from jobs import storage
from jobs.models import Job, Round
from scripts.stack import ROOT, free_port

from .conftest import _named, digits_npz
from .test_spine import create_job, run_until_done

pytestmark = pytest.mark.django_db(transaction=True)

KEYS = {"AWS_ACCESS_KEY_ID": "muninn-test", "AWS_SECRET_ACCESS_KEY": "muninn-test-secret"}


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server as its own process, as a MinIO or any S3-compatible server would be."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start: {server.stderr.read().decode()}") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture
def bucket(s3_endpoint, settings, monkeypatch, request):
    """A fresh bucket, and the site's settings as AWS_STORAGE_BUCKET_NAME and AWS_S3_ENDPOINT_URL make them
    (muninn/settings.py); changing STORAGES makes Django build default_storage again."""
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    name = f"muninn-{request.node.name.replace('_', '-')[:40]}"
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1",
                          aws_access_key_id=KEYS["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=KEYS["AWS_SECRET_ACCESS_KEY"])
    client.create_bucket(Bucket=name)
    settings.AWS_STORAGE_BUCKET_NAME = name
    settings.AWS_S3_ENDPOINT_URL = s3_endpoint
    settings.AWS_S3_REGION_NAME = "us-east-1"
    settings.STORAGES = {**settings.STORAGES, "default": {"BACKEND": "storages.backends.s3.S3Storage"}}
    storage._CACHE.clear()  # blobs an earlier test read are not in this bucket
    return client, name


def _objects(client, bucket_name: str) -> dict[str, bytes]:
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket_name)
            for o in page.get("Contents", [])]
    return {key: client.get_object(Bucket=bucket_name, Key=key)["Body"].read() for key in keys}


def test_a_whole_job_keeps_every_blob_in_the_bucket_and_none_on_local_disk(bucket, settings, customer_api,
                                                                          make_device):
    from muninn_worker import tensors
    from storages.backends.s3 import S3Storage

    client, bucket_name = bucket
    assert isinstance(default_storage, S3Storage)  # the real boto3 path, not a stand-in
    devices = [make_device("a"), make_device("b")]
    data = digits_npz(300)
    upload = customer_api.post("/api/datasets", {"file": _named(data, "digits.npz")}, format="multipart")
    assert upload.status_code == 201, upload.content
    job = create_job(customer_api, upload.json()["id"], rounds=2)

    done = run_until_done(devices, job["id"])

    assert done.status == Job.Status.SUCCEEDED
    objects = _objects(client, bucket_name)
    # Every object is a content-addressed blob: its key is the sha256 of its bytes.
    assert objects and all(key == storage.blob_path(hashlib.sha256(body).hexdigest())
                           for key, body in objects.items())
    stored = {key.rsplit("/", 1)[1] for key in objects}
    rounds = list(Round.objects.filter(job=done).order_by("number"))
    assert hashlib.sha256(data).hexdigest() in stored  # the dataset as uploaded
    assert {done.train_sha256, done.test_sha256, done.global_weights_sha256} <= stored
    for rnd in rounds:
        units = list(rnd.units.all())
        assert units and all(u.status == u.Status.ACCEPTED for u in units)
        assert {rnd.weights_sha256, rnd.result_sha256, rnd.shards_sha256} <= stored
        assert {u.result_sha256 for u in units} <= stored
        # Each shard was read from the round's pack with one ranged GET (storage.blob_range_open) and is its bytes.
        assert all(u.shard_offset is not None and storage.sha256_hex(jobs.unit_shard_bytes(u, key=None)) ==
                   u.shard_sha256 for u in units)
    # Nothing under MEDIA_ROOT: not a blob, not a folder.
    media = Path(settings.MEDIA_ROOT)
    assert not media.exists() or not any(media.rglob("*"))

    model = customer_api.get(f"/api/jobs/{done.pk}/model")
    assert model.status_code == 200
    downloaded = tensors.bytes_to_state_dict(b"".join(model.streaming_content))
    in_bucket = tensors.bytes_to_state_dict(objects[storage.blob_path(done.global_weights_sha256)])
    assert downloaded.keys() == in_bucket.keys()
    assert all((downloaded[k] == in_bucket[k]).all() for k in in_bucket)


def test_the_bucket_is_chosen_by_environment_variables(tmp_path):
    """What a deployment sets (README: "How it scales"), read by muninn/settings.py in a fresh process. Without
    AWS_STORAGE_BUCKET_NAME blobs stay local files: every other test runs that way."""
    code = ("from django.core.files.storage import default_storage as s; "
            "print(s.__class__.__name__, s.bucket_name, s.endpoint_url, s.region_name, s.access_key)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "STORAGE_BACKEND"}
    out = subprocess.run([sys.executable, "manage.py", "shell", "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120,
                         env={**env, **KEYS, "MUNINN_VAR_DIR": str(tmp_path), "SECRET_KEY": "x" * 50,
                              "PYTHONPATH": f"{ROOT / 'platform'}:{ROOT}", "AWS_STORAGE_BUCKET_NAME": "muninn-blobs",
                              "AWS_S3_ENDPOINT_URL": "http://minio.internal:9000", "AWS_S3_REGION_NAME": "eu-west-1"})

    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].split() == [  # the last line: `shell` first says what it imported
        "S3Storage", "muninn-blobs", "http://minio.internal:9000", "eu-west-1", KEYS["AWS_ACCESS_KEY_ID"]]
