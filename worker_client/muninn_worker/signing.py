"""Ed25519 keys, as base64 of their 32 raw bytes. A device's key pair is made at registration and signs every
receipt; the site's own key signs training certificates (muninn_worker.certificate).

A receipt's signature covers the exact bytes of the receipt JSON as uploaded, so the site verifies what it
received without any canonical form to agree on.
"""
from __future__ import annotations

import base64
import binascii

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat


def new_private_key() -> str:
    """A fresh private key, base64 of its 32 raw bytes (kept in the 0600 config file)."""
    raw = Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return base64.b64encode(raw).decode()


def _load(private_key: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(base64.b64decode(private_key))


def public_key_of(private_key: str) -> str:
    return base64.b64encode(_load(private_key).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


def sign(private_key: str, message: bytes) -> str:
    return base64.b64encode(_load(private_key).sign(message)).decode()


def verify(public_key: str, message: bytes, signature: str) -> bool:
    """Whether `signature` (base64) is the holder of `public_key`'s signature of `message`; False for a key or a
    signature that is not even well-formed base64 of the right length."""
    try:
        key = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key, validate=True))
        key.verify(base64.b64decode(signature, validate=True), message)
    except (binascii.Error, ValueError, TypeError, InvalidSignature):
        return False
    return True
