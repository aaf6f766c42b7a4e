"""Cheap checks on every uploaded result, before it is accepted: pure functions over plain values and tensors.

Each failure is a `ResultRejected` with a code and a sentence the contributor can act on.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import base64
import binascii

import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey


class ResultRejected(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Expected:
    unit_id: int
    weights_sha256: str
    shard_sha256: str
    samples: int


def load_public_key(encoded: str) -> Ed25519PublicKey:
    """A device's registered key: base64 of 32 raw Ed25519 bytes. ValueError when it is not one."""
    try:
        raw = base64.b64decode(encoded, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (binascii.Error, ValueError) as exc:
        raise ValueError("public_key must be base64 of a 32-byte Ed25519 public key") from exc


def check_signature(public_key: str, message: bytes, signature: str) -> None:
    """The receipt bytes were signed by the device's private key."""
    if not signature:
        raise ResultRejected("no_signature", "The receipt is not signed: send its Ed25519 signature as 'signature'.")
    try:
        load_public_key(public_key).verify(base64.b64decode(signature, validate=True), message)
    except (binascii.Error, ValueError, InvalidSignature):
        raise ResultRejected("bad_signature", "The receipt's signature does not verify with this device's key.") from None


def check_receipt(receipt: Mapping, *, expected: Expected, output_sha256: str) -> None:
    """The receipt must name this unit, the inputs the site served, and the bytes actually uploaded."""
    if receipt["unit"] != expected.unit_id:
        raise ResultRejected("receipt_unit_mismatch",
                             f"The receipt is for unit {receipt['unit']}, but it was posted to unit {expected.unit_id}.")
    if receipt["weights_sha256"] != expected.weights_sha256:
        raise ResultRejected("receipt_input_mismatch", "The receipt's weights_sha256 is not the round's global weights.")
    if receipt["shard_sha256"] != expected.shard_sha256:
        raise ResultRejected("receipt_input_mismatch", "The receipt's shard_sha256 is not this unit's shard.")
    if receipt["output_sha256"] != output_sha256:
        raise ResultRejected("receipt_output_mismatch",
                             "The receipt's output_sha256 does not match the sha256 of the uploaded weights.")
    if receipt["samples"] != expected.samples:
        raise ResultRejected("receipt_samples_mismatch",
                             f"The receipt claims {receipt['samples']} samples; the unit's shard has {expected.samples}.")
    if receipt["finished_at"] < receipt["started_at"]:
        raise ResultRejected("receipt_bad_times", "The receipt finishes before it starts.")


def check_state(result: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> None:
    """Same tensors as the global weights (names, shapes, dtypes), and every value finite."""
    missing = sorted(set(reference) - set(result))
    extra = sorted(set(result) - set(reference))
    if missing or extra:
        raise ResultRejected("wrong_tensors", f"Tensor names differ from the global weights: missing {missing[:5]}, "
                                              f"unexpected {extra[:5]}.")
    for name, ref in reference.items():
        got = result[name]
        if got.shape != ref.shape:
            raise ResultRejected("wrong_shape", f"Tensor '{name}' has shape {list(got.shape)}; expected {list(ref.shape)}.")
        if got.dtype != ref.dtype:
            raise ResultRejected("wrong_dtype", f"Tensor '{name}' has dtype {got.dtype}; expected {ref.dtype}.")
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise ResultRejected("not_finite", f"Tensor '{name}' contains NaN or Inf values.")
