"""Update codecs: a trained state travels as its delta against the round's global weights, encoded as
fp32, fp16, or int8 with one scale per tensor, inside a safetensors file, deflated on the wire.

Pure torch, shared by the client (encode) and the site (decode, and re-execution's encode → decode), so both
always agree.
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch
from torch import Tensor

from .tensors import NotSafetensors, bytes_to_state_dict, plain_tensors, state_dict_to_bytes

ENCODINGS = ("fp32", "fp16", "int8")
WIRE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}
SCALE_SUFFIX = ".__scale__"
MAX_INFLATED_BYTES = 4 << 30  # a deflated upload may not expand past this (no zip bombs)


class BadUpdate(ValueError):
    """An encoded update that does not fit the global weights it claims to be relative to. `code` says how, in
    the site's words: not_safetensors, too_large, wrong_tensors, wrong_shape, wrong_dtype, no_scale."""

    def __init__(self, message: str, code: str = "bad_update"):
        super().__init__(message)
        self.code, self.message = code, message


def encode_update(new: Mapping[str, Tensor], base: Mapping[str, Tensor], encoding: str) -> bytes:
    """`new - base` per floating tensor in `encoding`; other tensors (counters) as they are. Deflated."""
    return pack(encode_tensors(new, base, encoding), encoding)


def encode_tensors(new: Mapping[str, Tensor], base: Mapping[str, Tensor], encoding: str) -> dict[str, Tensor]:
    """The tensors `encode_update` packs (int8: each with its scale beside it, as NAME.__scale__)."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding!r}; choose one of {', '.join(ENCODINGS)}")
    out: dict[str, Tensor] = {}
    for name, value in new.items():
        if not value.is_floating_point():
            out[name] = value
            continue
        delta = value.float() - base[name].float()
        if encoding == "fp32":
            out[name] = delta
        elif encoding == "fp16":
            out[name] = delta.half()
        else:
            scale = delta.abs().max() / 127.0 if delta.numel() else torch.tensor(0.0)
            scale = scale if scale > 0 else torch.tensor(1.0)
            out[name] = torch.round(delta / scale).clamp_(-127, 127).to(torch.int8)
            out[name + SCALE_SUFFIX] = scale.reshape(1).float()
    return out


def pack(encoded: Mapping[str, Tensor], encoding: str) -> bytes:
    """The wire form of already-encoded tensors: safetensors (with the encoding in its metadata), deflated."""
    return zlib.compress(state_dict_to_bytes(dict(encoded), metadata={"encoding": encoding}), 6)


def unpack(data: bytes, max_inflated_bytes: int = MAX_INFLATED_BYTES) -> dict[str, Tensor]:
    """The encoded tensors inside an upload, inflating at most `max_inflated_bytes` (no zip bombs)."""
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(data, max_inflated_bytes)
        if inflater.unconsumed_tail:
            raise BadUpdate(f"the update expands past {max_inflated_bytes:,} bytes, more than these weights can be",
                            code="too_large")
        if not inflater.eof:
            raise BadUpdate("the update is truncated: the deflated stream ends early", code="not_safetensors")
    except zlib.error as exc:
        raise BadUpdate(f"the update is not deflated safetensors: {exc}", code="not_safetensors") from None
    try:
        return bytes_to_state_dict(raw)
    except NotSafetensors as exc:
        raise BadUpdate(f"the inflated update is {exc}", code="not_safetensors") from None


def decode_update(data: bytes, base: Mapping[str, Tensor], encoding: str,
                  max_inflated_bytes: int = MAX_INFLATED_BYTES) -> dict[str, Tensor]:
    """The full new state (`base + delta`, in base's dtypes) from `encode_update`'s bytes. BadUpdate (with a
    code) for anything that is not such an update of exactly these tensors."""
    return decode_tensors(unpack(data, max_inflated_bytes), base, encoding)


def decode_tensors(encoded: Mapping[str, Tensor], base: Mapping[str, Tensor], encoding: str) -> dict[str, Tensor]:
    """`decode_update` of the tensors inside an upload (BadUpdate for any that do not fit `base`)."""
    scales = {k[: -len(SCALE_SUFFIX)]: v for k, v in encoded.items() if k.endswith(SCALE_SUFFIX)}
    tensors = {k: v for k, v in encoded.items() if not k.endswith(SCALE_SUFFIX)}
    if set(tensors) != set(base) or not set(scales) <= set(base):
        missing, extra = sorted(set(base) - set(tensors)), sorted((set(tensors) | set(scales)) - set(base))
        raise BadUpdate(f"tensor names differ from the global weights: missing {missing[:5]}, unexpected {extra[:5]}",
                        code="wrong_tensors")
    expected = WIRE_DTYPES[encoding]
    state: dict[str, Tensor] = {}
    for name, ref in base.items():
        value = tensors[name]
        if value.shape != ref.shape:
            raise BadUpdate(f"tensor '{name}' has shape {list(value.shape)}; expected {list(ref.shape)}",
                            code="wrong_shape")
        if not ref.is_floating_point():
            if value.dtype != ref.dtype:
                raise BadUpdate(f"tensor '{name}' has dtype {value.dtype}; expected {ref.dtype}", code="wrong_dtype")
            state[name] = value
            continue
        if value.dtype != expected:
            raise BadUpdate(f"tensor '{name}' is {value.dtype}; a {encoding} update carries {expected}",
                            code="wrong_dtype")
        delta = value.float()
        if encoding == "int8":
            scale = scales.get(name)
            if scale is None or scale.numel() != 1 or not scale.is_floating_point():
                raise BadUpdate(f"tensor '{name}' has no scale: an int8 update carries one float per tensor "
                                f"as '{name}{SCALE_SUFFIX}'", code="no_scale")
            delta = delta * scale.float()
        state[name] = (ref.float() + delta).to(ref.dtype)
    return state


def roundtrip(new: Mapping[str, Tensor], base: Mapping[str, Tensor], encoding: str) -> dict[str, Tensor]:
    """What the site makes of `new` once it has travelled in `encoding`: re-execution compares through this.
    Without the bytes between: safetensors carries tensors exactly, so the tensors as the wire would hold them
    (tensors.plain_tensors, what state_dict_to_bytes writes) decode to the same values, without serialising and
    deflating the whole model twice (a fifth of the site's time on a challenged checkpoint, py-spy under
    bench/round_latency.py)."""
    return decode_tensors(plain_tensors(encode_tensors(new, base, encoding)), base, encoding)
