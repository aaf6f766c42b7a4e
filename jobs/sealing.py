"""Sensitive datasets at rest: AES-256-GCM under a key of each dataset, that key wrapped under the site's data key.

Everything else about a blob stays as it is: the database, the worker protocol and every receipt name a blob by the
sha256 of its plaintext (what a device verifies after its download), so sealing changes only what storage holds and
where. A sealed blob lives at sealed/<hh>/<name>, its name an HMAC of the plaintext's sha256 under the dataset's key:
storage shows neither the plaintext nor its hash (a hash of known rows would confirm a guess), yet the same blob of
the same dataset always lands at the same place, so a task that runs twice writes it once. Its bytes are
MAGIC | 12-byte nonce | ciphertext and tag, with the plaintext's sha256 as associated data; opening checks that hash
again, so a sealed blob is as tamper-evident as a plain content-addressed one.

The site's data key: MUNINN_DATA_KEY (base64 of 32 bytes) when set, else HKDF-SHA256 of SECRET_KEY. Lose it (or
change SECRET_KEY with MUNINN_DATA_KEY unset) and every sensitive dataset's blobs are unreadable: production sets
MUNINN_DATA_KEY and keeps it with the database backups, never beside the bucket.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from muninn.errors import MuninnError

MAGIC = b"MSB1"  # "Muninn sealed blob", version 1
WRAP_MAGIC = b"MWK1"  # a wrapped dataset key, version 1
NONCE_BYTES = 12
KEY_BYTES = 32


class SealError(MuninnError):
    """A sealed blob or wrapped key that does not open: the wrong key, or bytes changed in storage. The site's
    fault, never the caller's: a request that meets it is answered 503 `data_unreadable` (and logged), and
    nothing is recorded or changed."""

    code = "data_unreadable"
    status = 503


def site_data_key() -> bytes:
    """The key that wraps every dataset key (see the module's docstring)."""
    given = getattr(settings, "MUNINN_DATA_KEY", "")
    if given:
        try:
            raw = base64.b64decode(given, validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if len(raw) != KEY_BYTES:
            raise ImproperlyConfigured(
                "MUNINN_DATA_KEY must be base64 of 32 random bytes "
                "(python -c 'import os,base64; print(base64.b64encode(os.urandom(32)).decode())')")
        return raw
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=b"muninn",
                info=b"muninn dataset key wrapping v1").derive(settings.SECRET_KEY.encode())


def new_dataset_key() -> bytes:
    return os.urandom(KEY_BYTES)


def wrap_key(key: bytes, *, site_key: bytes, label: str) -> bytes:
    """`key` encrypted under the site's key; `label` (the dataset's sha256) binds it to its dataset."""
    nonce = os.urandom(NONCE_BYTES)
    return WRAP_MAGIC + nonce + AESGCM(site_key).encrypt(nonce, key, label.encode())


def unwrap_key(wrapped: bytes, *, site_key: bytes, label: str) -> bytes:
    wrapped = bytes(wrapped)
    if not wrapped.startswith(WRAP_MAGIC):
        raise SealError("not a wrapped dataset key")
    nonce = wrapped[len(WRAP_MAGIC):len(WRAP_MAGIC) + NONCE_BYTES]
    try:
        return AESGCM(site_key).decrypt(nonce, wrapped[len(WRAP_MAGIC) + NONCE_BYTES:], label.encode())
    except Exception as e:  # cryptography's InvalidTag: the wrong site key, or the row was changed
        raise SealError("the dataset's key does not open with the site's data key (MUNINN_DATA_KEY changed?)") from e


def seal(data: bytes, key: bytes, *, sha256: str) -> bytes:
    nonce = os.urandom(NONCE_BYTES)
    return MAGIC + nonce + AESGCM(key).encrypt(nonce, data, sha256.encode())


def unseal(sealed: bytes, key: bytes, *, sha256: str) -> bytes:
    if not sealed.startswith(MAGIC):
        raise SealError("not a sealed blob")
    nonce = sealed[len(MAGIC):len(MAGIC) + NONCE_BYTES]
    try:
        data = AESGCM(key).decrypt(nonce, sealed[len(MAGIC) + NONCE_BYTES:], sha256.encode())
    except Exception as e:
        raise SealError(f"sealed blob {sha256[:12]}… does not open with its dataset's key") from e
    if hashlib.sha256(data).hexdigest() != sha256:
        raise SealError(f"sealed blob {sha256[:12]}… opened to other bytes")
    return data


def sealed_name(key: bytes, sha256: str) -> str:
    """Where a sealed blob lives, from its plaintext's hash (see the module's docstring)."""
    return hmac.new(key, b"muninn-sealed-name:" + sha256.encode(), hashlib.sha256).hexdigest()
