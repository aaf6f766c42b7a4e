"""Update codecs: deltas in fp32/fp16/int8 decode back to the trained weights within each format's error."""
import zlib

import pytest
import torch

from muninn_worker.codec import BadUpdate, decode_update, encode_update, roundtrip
from muninn_worker.tensors import state_dict_to_bytes


def states():
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "steps": torch.tensor([3])}
    new = {"w": base["w"] + 0.01 * torch.randn(64, 32, generator=g), "b": base["b"].clone(),
           "steps": torch.tensor([4])}
    return base, new


@pytest.mark.parametrize("encoding, tolerance", [("fp32", 1e-6), ("fp16", 2e-5), ("int8", 0.04 / 127)])
def test_update_decodes_to_the_trained_weights_within_the_format_error(encoding, tolerance):
    base, new = states()

    decoded = decode_update(encode_update(new, base, encoding), base, encoding)

    assert (decoded["w"] - new["w"]).abs().max() <= tolerance
    assert torch.equal(decoded["b"], new["b"])  # an untouched tensor comes back exactly
    assert torch.equal(decoded["steps"], new["steps"]) and decoded["w"].dtype == torch.float32


def test_narrower_encodings_send_fewer_bytes():
    base, new = states()
    sizes = {e: len(encode_update(new, base, e)) for e in ("fp32", "fp16", "int8")}
    assert sizes["int8"] < sizes["fp16"] < sizes["fp32"]


def test_update_with_other_tensors_is_refused():
    base, new = states()
    data = encode_update({**new, "extra": torch.zeros(2)}, {**base, "extra": torch.zeros(2)}, "fp32")
    with pytest.raises(BadUpdate, match="unexpected"):
        decode_update(data, base, "fp32")


def test_update_in_another_encoding_than_the_job_is_refused():
    base, new = states()
    with pytest.raises(BadUpdate, match="int8"):
        decode_update(encode_update(new, base, "fp16"), base, "int8")


def test_int8_update_without_scales_is_refused():
    base, new = states()
    raw = {"w": torch.zeros(64, 32, dtype=torch.int8), "b": torch.zeros(32, dtype=torch.int8), "steps": new["steps"]}
    with pytest.raises(BadUpdate, match="scale"):
        decode_update(zlib.compress(state_dict_to_bytes(raw)), base, "int8")


def test_a_deflate_bomb_or_garbage_is_refused():
    base, _ = states()
    with pytest.raises(BadUpdate):
        decode_update(b"not deflated at all", base, "fp32")
    with pytest.raises(BadUpdate):
        decode_update(zlib.compress(state_dict_to_bytes(base))[:-10], base, "fp32")


@pytest.mark.parametrize("data, code", [
    (b"not deflated at all", "not_safetensors"),
    (zlib.compress(b"deflated, but not safetensors"), "not_safetensors"),
    (zlib.compress(bytes(4096)), "too_large"),  # inflates past the limit given
])
def test_undecodable_updates_say_why_with_a_code(data, code):
    base, _ = states()
    with pytest.raises(BadUpdate) as refused:
        decode_update(data, base, "fp32", max_inflated_bytes=1024)
    assert refused.value.code == code


@pytest.mark.parametrize("encoding", ["fp32", "fp16", "int8"])
@pytest.mark.parametrize("seed", range(5))
def test_roundtrip_is_what_the_site_decodes_from_an_honest_upload(encoding, seed):
    """roundtrip skips the bytes; it must still give bit for bit what decoding the upload gives, with every
    dtype, an unchanged tensor (a zero delta: int8's scale of 1) and non-finite values (what a diverged
    training leaves)."""
    g = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "steps": torch.tensor([3]),
            "h": torch.randn(8, generator=g).half(), "same": torch.randn(4, generator=g)}
    new = {"w": base["w"] + 0.01 * torch.randn(64, 32, generator=g), "b": base["b"] * 3, "steps": torch.tensor([4]),
           "h": base["h"] + 0.5, "same": base["same"].clone()}
    if seed == 4:
        new["b"][0] = float("nan")
        new["w"][1, 1] = float("inf")
    expected = decode_update(encode_update(new, base, encoding), base, encoding)
    got = roundtrip(new, base, encoding)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype
        assert torch.equal(got[name].view(torch.uint8) if value.is_floating_point() else got[name],
                           value.view(torch.uint8) if value.is_floating_point() else value), name
