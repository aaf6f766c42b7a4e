"""Weights on the wire are safetensors only; pickles are refused, never loaded."""

from __future__ import annotations

import hashlib
import io
import pickle

import pytest
import torch

from muninn_worker.tensors import (
    BadShard,
    NotSafetensors,
    bytes_to_shard,
    bytes_to_state_dict,
    sha256_hex,
    shard_to_bytes,
    state_dict_to_bytes,
)
from muninn_worker.zoo import init_state

CONFIG = {"in_features": 5, "num_classes": 3, "hidden": [4]}


def test_state_dict_roundtrips_exactly():
    state = init_state("mlp", CONFIG, seed=3)

    loaded = bytes_to_state_dict(state_dict_to_bytes(state, metadata={"job": "3"}))

    assert loaded.keys() == state.keys()
    for key in state:
        assert loaded[key].dtype == state[key].dtype and torch.equal(loaded[key], state[key])


def test_same_tensors_give_the_same_bytes():
    assert state_dict_to_bytes(init_state("mlp", CONFIG, 1)) == state_dict_to_bytes(init_state("mlp", CONFIG, 1))


def test_same_tensors_and_metadata_give_the_same_bytes():
    # safetensors itself writes metadata in a hash map's order, different at almost every call.
    metadata = {name: "x" for name in ("muninn_template", "muninn_job", "muninn_data", "muninn_model_config", "z")}

    files = {state_dict_to_bytes(init_state("mlp", CONFIG, 1), metadata=dict(metadata)) for _ in range(20)}

    assert len(files) == 1
    data = files.pop()
    assert data.index(b'"muninn_data"') < data.index(b'"muninn_job"') < data.index(b'"z"')
    assert int.from_bytes(data[:8], "little") % 8 == 0
    assert state_dict_to_bytes(bytes_to_state_dict(data)) == state_dict_to_bytes(init_state("mlp", CONFIG, 1))


def test_tied_tensors_are_serialised():
    weight = torch.ones(2, 2)

    loaded = bytes_to_state_dict(state_dict_to_bytes({"a": weight, "b": weight}))

    assert torch.equal(loaded["a"], loaded["b"])


@pytest.mark.parametrize("payload", [
    pickle.dumps({"weight": [1.0, 2.0]}),
    pickle.dumps({"weight": torch.ones(2)}, protocol=2),
], ids=["pickle", "pickle-protocol-2"])
def test_pickle_is_refused(payload):
    with pytest.raises(NotSafetensors, match="pickle"):
        bytes_to_state_dict(payload)


def test_torch_save_archive_is_refused():
    buffer = io.BytesIO()
    torch.save({"weight": torch.ones(2)}, buffer)

    with pytest.raises(NotSafetensors, match="torch.save"):
        bytes_to_state_dict(buffer.getvalue())


@pytest.mark.parametrize("payload", [b"", b"hello", b"\xff" * 64, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}xxxxx"])
def test_garbage_is_refused(payload):
    with pytest.raises(NotSafetensors):
        bytes_to_state_dict(payload)


def test_truncated_safetensors_is_refused():
    data = state_dict_to_bytes(init_state("mlp", CONFIG, 1))

    with pytest.raises(NotSafetensors):
        bytes_to_state_dict(data[:-10])


def test_shard_roundtrip_and_validation():
    X, y = torch.randn(6, 5), torch.arange(6) % 3

    X2, y2 = bytes_to_shard(shard_to_bytes(X, y))

    assert torch.equal(X2, X) and torch.equal(y2, y) and y2.dtype == torch.int64
    with pytest.raises(BadShard, match="rows"):
        bytes_to_shard(state_dict_to_bytes({"X": X, "y": y[:5]}))
    with pytest.raises(BadShard, match="exactly"):
        bytes_to_shard(state_dict_to_bytes({"X": X}))


def test_sha256_hex_matches_hashlib():
    assert sha256_hex(b"muninn") == hashlib.sha256(b"muninn").hexdigest()


def test_a_header_whose_length_starts_like_a_pickle_is_still_safetensors():
    # A 640-byte header is stored as 0x80 0x02 ..., the first two bytes of a protocol-2 pickle.
    sd = {"w": torch.zeros(2)}
    sized = (state_dict_to_bytes(sd, metadata={"pad": "x" * n}) for n in range(700))
    data = next(d for d in sized if int.from_bytes(d[:8], "little") == 640)

    assert data[:2] == b"\x80\x02"
    assert torch.equal(bytes_to_state_dict(data)["w"], sd["w"])


def _random_state(rng) -> dict:
    """A state of 0-8 tensors: every dtype, names that sort every way (and some safetensors writes itself),
    0-d, empty and small shapes."""
    from muninn_worker import tensors

    state = {}
    for _ in range(rng.randint(0, 8)):
        name = rng.choice(["w", "b", "layer.0.weight", "A", "a", "layer.10.bias", "z_", "x y", "é", 'q"', "0"])
        dtype = rng.choice(list(tensors._DTYPES))
        shape = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
        if dtype == torch.bool:
            value = torch.rand(shape) > 0.5
        elif dtype.is_floating_point:
            value = torch.randn(shape).to(dtype)
        else:
            value = torch.randint(0, 100, shape).to(dtype)
        state[name + str(rng.randint(0, 3))] = value
    return state


def test_state_bytes_are_exactly_what_safetensors_writes():
    """The bytes are hashed into commitments on both sides of the wire: the site and every client version must
    write the very same bytes for the same tensors, and safetensors' own save is what older clients used."""
    import random

    from safetensors.torch import save

    from muninn_worker.tensors import _metadata_sorted, plain_tensors

    rng = random.Random(7)
    for _ in range(2000):
        state = _random_state(rng)
        assert state_dict_to_bytes(state) == save(plain_tensors(state)), state
        metadata = {rng.choice(["encoding", "job", "é", 'q"', "a b", "\n"]): rng.choice(["fp32", "3", "ü\t", ""])
                    for _ in range(rng.randint(1, 3))}
        written = _metadata_sorted(save(plain_tensors(state), metadata=metadata))
        assert state_dict_to_bytes(state, metadata=metadata) == written, (state, metadata)
    model = init_state("mlp", CONFIG, seed=3)
    assert state_dict_to_bytes(model) == save(plain_tensors(model))
    transposed = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    assert state_dict_to_bytes({"w": transposed}) == save({"w": transposed.contiguous()})
