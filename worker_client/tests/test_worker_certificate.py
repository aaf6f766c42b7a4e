"""The offline certificate check on a hand-made certificate (the site's own: tests/test_certificate.py)."""

from __future__ import annotations

import hashlib
import json

import pytest

from muninn_worker import certificate, signing
from muninn_worker.cli import main
from muninn_worker.tensors import sha256_hex, state_dict_to_bytes
from muninn_worker.zoo import init_state

CONFIG = {"in_features": 5, "num_classes": 3, "hidden": [4]}
SITE = signing.new_private_key()


def _made(tmp_path, **change) -> tuple[dict, bytes]:
    """A one-round certificate of an mlp, its model file, signed by SITE; `change` edits it before signing."""
    initial = sha256_hex(state_dict_to_bytes(init_state("mlp", CONFIG, 1)))
    final = init_state("mlp", CONFIG, 2)
    model = state_dict_to_bytes(final, metadata={"muninn_template": "mlp", "muninn_job": "7"})
    unit = {"in_model": True, "steps": 8, "verification": {"method": "site_reexecution", "retrained_steps": 2}}
    body = {"format": certificate.FORMAT, "job": {"id": 7, "template": "mlp", "rounds": 1},
            "initial_weights_sha256": initial,
            "rounds": [{"number": 1, "weights_before_sha256": initial, "units": [unit],
                        "weights_after_sha256": sha256_hex(state_dict_to_bytes(final))}],
            "verification": {"trained_steps": 8, "retrained_steps": 2},
            "model": {"final_weights_sha256": sha256_hex(state_dict_to_bytes(final)),
                      "file_sha256": hashlib.sha256(model).hexdigest()}}
    for path, value in change.items():
        *parents, last = path.split("__")
        target = body
        for name in parents:
            target = target[int(name)] if name.isdigit() else target[name]
        target[last] = value
    return certificate.sign(body, SITE), model


def _run(tmp_path, capsys, document: dict, model: bytes, key: str) -> tuple[int, str, str]:
    (tmp_path / "c.json").write_bytes(certificate.canonical(document))
    (tmp_path / "m.safetensors").write_bytes(model)
    code = main(["verify-certificate", str(tmp_path / "c.json"), str(tmp_path / "m.safetensors"), "--key", key])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, err
    return code, out, err


@pytest.mark.parametrize("key_form", ["base64", "file", "well-known"])
def test_a_sound_certificate_passes_with_the_key_in_any_form(tmp_path, capsys, key_form):
    public = signing.public_key_of(SITE)
    key = {"base64": public, "file": public + "\n",
           "well-known": json.dumps({"algorithm": "Ed25519", "key": public})}[key_form]
    if key_form != "base64":
        (tmp_path / "key").write_text(key)
        key = str(tmp_path / "key")

    code, out, err = _run(tmp_path, capsys, *_made(tmp_path), key)

    assert code == 0, err
    assert out.startswith("certificate OK: job 7 (mlp)") and "2 of 8 training steps re-trained (25.0%)" in out


@pytest.mark.parametrize(("change", "sentence"), [
    ({"rounds__0__weights_after_sha256": "f" * 64}, "does not end at the model"),
    ({"rounds__0__weights_before_sha256": "e" * 64}, "breaks at round 1"),
    ({"job__rounds": 2}, "lists 1 rounds, but the job had 2"),
    ({"verification__retrained_steps": 8}, "does not add up"),
    ({"model__file_sha256": "0" * 64}, "its metadata differs"),
    ({"format": "muninn-certificate/9"}, "format"),
])
def test_a_signed_certificate_that_does_not_hold_together_fails_saying_which_check(tmp_path, capsys, change,
                                                                                      sentence):
    code, _, err = _run(tmp_path, capsys, *_made(tmp_path, **change), signing.public_key_of(SITE))

    assert code == 1 and sentence in err


def test_a_key_that_is_no_key_exits_2_with_a_sentence(tmp_path, capsys):
    code, _, err = _run(tmp_path, capsys, *_made(tmp_path), "not-a-key")

    assert code == 2 and "not a base64 Ed25519 public key" in err
