"""Training certificates: what the site signs about a job that succeeded, and the offline check of one.

A certificate file is a JSON document {"certificate": {...}, "signature": "<base64>", "key": "<base64>",
"algorithm": "Ed25519"}: the signature is the site's Ed25519 signature of `canonical(certificate)`, the
certificate's canonical bytes (keys sorted, no spaces, UTF-8: Python's json.dumps with sort_keys=True,
separators=(",", ":"), ensure_ascii=False). "key" only says which key signed it; trust comes from the key the
checker is given (the site's /.well-known/muninn-signing-key), never from the file itself.

The site builds certificates (jobs/certificates.py) and `muninn-worker verify-certificate` checks them with this
module, so the two never disagree on the canonical form or on what a check means. Importing it loads no torch;
only the model file's weights check does.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
from typing import Any

from muninn_worker import signing

FORMAT = "muninn-certificate/1"
ALGORITHM = "Ed25519"


class CertificateInvalid(Exception):
    """A check failed; the message is one sentence saying which."""


def canonical(value: Any) -> bytes:
    """The bytes a certificate's signature covers."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def sign(certificate: dict, private_key: str) -> dict:
    """The signed document for a certificate, with `private_key` (base64 raw Ed25519)."""
    return {"certificate": certificate, "signature": signing.sign(private_key, canonical(certificate)),
            "key": signing.public_key_of(private_key), "algorithm": ALGORITHM}


def public_key_from(text: str) -> str:
    """The base64 public key in `text`: the key itself, or the site's /.well-known/muninn-signing-key JSON.
    Raises ValueError with a sentence when it is neither."""
    text = text.strip()
    if text.startswith("{"):
        try:
            published = json.loads(text)
        except ValueError:
            raise ValueError("the key file is not valid JSON") from None
        if not isinstance(published, dict) or not isinstance(published.get("key"), str):
            raise ValueError("the key JSON has no \"key\" (expected the site's /.well-known/muninn-signing-key)")
        if published.get("algorithm", ALGORITHM) != ALGORITHM:
            raise ValueError(f"the key is for {published['algorithm']!r}, not {ALGORITHM}")
        text = published["key"].strip()
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ValueError("the key is not a base64 Ed25519 public key (32 bytes)")
    return text


def weights_sha256(model: bytes) -> str:
    """The sha256 of a model file's tensors alone, written as the site writes global weights (safetensors without
    metadata): what the certificate calls the final global weights' sha256."""
    from muninn_worker import tensors

    return hashlib.sha256(tensors.state_dict_to_bytes(tensors.bytes_to_state_dict(model))).hexdigest()


def check(document: Any, model: bytes, public_key: str) -> dict:
    """Check a certificate document against a model file and the site's public key: the signature, the chain of
    every round's weights from the initial weights to the final ones, the re-checked compute adding up, the model
    file's sha256 and its weights. Returns a short summary; raises CertificateInvalid naming the first failed check."""
    if not (isinstance(document, dict) and isinstance(document.get("certificate"), dict)
            and isinstance(document.get("signature"), str)):
        raise CertificateInvalid("The file is not a Muninn certificate: it has no \"certificate\" object and "
                                 "\"signature\" string.")
    certificate = document["certificate"]
    if not signing.verify(public_key, canonical(certificate), document["signature"]):
        if document.get("key") not in (None, public_key):
            raise CertificateInvalid("The signature does not verify with the key given: the certificate was signed "
                                     "with another key, not the site's.")
        raise CertificateInvalid("The signature does not verify with the site's key: the certificate (or its "
                                 "signature) was changed after the site signed it.")
    if certificate.get("format") != FORMAT:
        raise CertificateInvalid(f"The certificate's format is {certificate.get('format')!r}; this client checks "
                                 f"{FORMAT!r} (update muninn-worker).")
    try:
        summary = _check_contents(certificate)
    except (KeyError, TypeError, IndexError) as e:
        raise CertificateInvalid(f"The certificate is signed but lacks a field this check needs ({e}).") from None
    _check_model(certificate["model"], model)
    return {**summary, "key": public_key}


def _check_contents(certificate: dict) -> dict:
    rounds = certificate["rounds"]
    if not rounds or [r["number"] for r in rounds] != list(range(1, len(rounds) + 1)):
        raise CertificateInvalid("The rounds are not numbered 1, 2, 3, … without a gap.")
    if len(rounds) != certificate["job"]["rounds"]:
        raise CertificateInvalid(f"The certificate lists {len(rounds)} rounds, but the job had "
                                 f"{certificate['job']['rounds']}.")
    before = certificate["initial_weights_sha256"]
    for rnd in rounds:
        if rnd["weights_before_sha256"] != before:
            after_what = ("the initial weights" if rnd["number"] == 1 else f"round {rnd['number'] - 1}'s weights after")
            raise CertificateInvalid(f"The weights chain breaks at round {rnd['number']}: its weights before "
                                     f"({rnd['weights_before_sha256'][:12]}…) are not {after_what} ({before[:12]}…).")
        if not any(unit["in_model"] for unit in rnd["units"]):
            raise CertificateInvalid(f"Round {rnd['number']} names no update that made its weights.")
        before = rnd["weights_after_sha256"]
    final = certificate["model"]["final_weights_sha256"]
    if before != final:
        raise CertificateInvalid(f"The weights chain does not end at the model: the last round's weights after "
                                 f"({before[:12]}…) are not the final weights ({final[:12]}…).")
    units = [unit for rnd in rounds for unit in rnd["units"] if unit["in_model"]]
    trained = sum(unit["steps"] for unit in units)
    retrained = sum(unit["verification"]["retrained_steps"] for unit in units)
    stated = certificate["verification"]
    if (trained, retrained) != (stated["trained_steps"], stated["retrained_steps"]):
        raise CertificateInvalid(f"The re-checked compute does not add up: the units show {retrained} of {trained} "
                                 f"steps re-trained, the certificate states {stated['retrained_steps']} of "
                                 f"{stated['trained_steps']}.")
    methods = [unit["verification"]["method"] for unit in units]
    return {"job": certificate["job"]["id"], "template": certificate["job"]["template"], "rounds": len(rounds),
            "units": len(units), "site_checked": methods.count("site_reexecution"),
            "peer_checked": methods.count("peer_check"), "cheap_checks_only": methods.count("cheap_checks"),
            "trained_steps": trained, "retrained_steps": retrained,
            "flagged": sum(len(rnd.get("flagged") or []) for rnd in rounds),
            "final_weights_sha256": final, "file_sha256": certificate["model"]["file_sha256"]}


def _check_model(stated: dict, model: bytes) -> None:
    file_sha = hashlib.sha256(model).hexdigest()
    try:
        weights = weights_sha256(model)
    except ValueError:  # tensors.NotSafetensors
        weights = None
    if file_sha != stated["file_sha256"]:
        if weights == stated["final_weights_sha256"]:
            raise CertificateInvalid(f"The model file's sha256 ({file_sha[:12]}…) is not the certificate's "
                                     f"({stated['file_sha256'][:12]}…), though its weights are the certified ones: "
                                     "its metadata differs, so download the model and its certificate again.")
        raise CertificateInvalid(f"The model file's sha256 ({file_sha[:12]}…) is not the certificate's "
                                 f"({stated['file_sha256'][:12]}…): it is not the certified model.")
    if weights != stated["final_weights_sha256"]:
        raise CertificateInvalid("The model file's weights are not the certified final weights "
                                 f"({stated['final_weights_sha256'][:12]}…).")
