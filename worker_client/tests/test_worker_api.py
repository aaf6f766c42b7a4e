"""ApiClient against the fake site: auth, error mapping, the hash-checked download cache."""

from __future__ import annotations

import pytest

from muninn_worker.api import ApiClient, ApiError, NetworkError
from muninn_worker.cache import HashMismatch
from muninn_worker.signing import new_private_key, public_key_of, sign
from muninn_worker.tensors import sha256_hex


def _client(site, **kwargs) -> ApiClient:
    return ApiClient(site.url, device_token=site.device_token, attempts=2, retry_sleep=lambda s: None, **kwargs)


def test_claim_returns_none_when_there_is_no_work(fake_site):
    assert _client(fake_site).claim() is None


def test_claim_returns_the_unit(fake_site):
    fake_site.add_unit(unit_id=5)

    unit = _client(fake_site).claim()

    assert unit["id"] == 5 and unit["template"] == "mlp" and unit["train"]["seed"] == 1234


def test_error_body_becomes_api_error(fake_site):
    client = ApiClient(fake_site.url, device_token="wrong", attempts=1)

    with pytest.raises(ApiError) as error:
        client.claim()

    assert (error.value.status, error.value.code, error.value.message) == (
        401, "not_authenticated", "Invalid device token.")


def test_server_errors_are_retried(fake_site):
    fake_site.claim_statuses = [503]
    fake_site.add_unit()

    assert _client(fake_site).claim()["id"] == 42


def test_unreachable_server_is_a_network_error():
    client = ApiClient("http://127.0.0.1:9", device_token="t", attempts=2, retry_sleep=lambda s: None)

    with pytest.raises(NetworkError, match="cannot reach"):
        client.claim()


def test_download_verifies_and_caches_by_hash(fake_site, tmp_path):
    unit = fake_site.add_unit()
    client = _client(fake_site)

    first = client.download(42, "weights", sha256_hex(unit.weights), tmp_path)
    second = client.download(42, "weights", sha256_hex(unit.weights), tmp_path)

    assert first == second == unit.weights
    assert fake_site.gets("/weights") == 1
    assert (tmp_path / "sha256" / sha256_hex(unit.weights)[:2] / sha256_hex(unit.weights)).exists()


def test_download_with_wrong_hash_is_refused_and_not_cached(fake_site, tmp_path):
    unit = fake_site.add_unit()
    fake_site.corrupt_downloads = True

    with pytest.raises(HashMismatch):
        _client(fake_site).download(42, "shard", sha256_hex(unit.shard), tmp_path)

    assert not list(tmp_path.rglob("*" + sha256_hex(unit.shard)))


def test_download_reports_progress(fake_site, tmp_path):
    unit = fake_site.add_unit()
    seen: list[tuple[int, int | None]] = []

    _client(fake_site).download(42, "shard", sha256_hex(unit.shard), tmp_path,
                                progress=lambda done, total: seen.append((done, total)))

    assert seen[-1] == (len(unit.shard), len(unit.shard))


def test_register_uses_the_account_token(fake_site):
    client = ApiClient(fake_site.url, account_token=fake_site.account_token, attempts=1)
    capabilities = {"cpu_cores": 1, "ram_bytes": 1, "backends": ["cpu"], "gpus": [], "torch_version": "2",
                    "samples_per_s": 1.0, "flops_per_s": 1.0}

    answer = client.register_device("box", capabilities, public_key_of(new_private_key()))

    assert answer == {"device_id": 7, "device_token": fake_site.device_token, "name": "box"}


def test_server_url_must_be_http():
    with pytest.raises(ValueError, match="http"):
        ApiClient("ftp://example.com")


def test_signing_key_signs_the_exact_receipt_bytes():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    import base64

    key = new_private_key()
    message = b'{"unit":1}'
    signature = base64.b64decode(sign(key, message))
    public = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key_of(key)))
    public.verify(signature, message)  # raises if it does not verify
    with pytest.raises(Exception):
        public.verify(signature, b'{"unit": 1}')
