"""Update codecs: a trained state travels as its delta against the round's global weights, encoded as
fp32, fp16, or int8 with one scale per tensor, inside a safetensors file, deflated on the wire.

Pure torch, shared by the client (encode) and the site (decode), so both always agree.
"""
from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch
from torch import Tensor

from .tensors import bytes_to_state_dict, state_dict_to_bytes

ENCODINGS = ("fp32", "fp16", "int8")
SCALE_SUFFIX = ".__scale__"
MAX_INFLATED_BYTES = 4 << 30  # a deflated upload may not expand past this (no zip bombs)


class BadUpdate(ValueError):
    """An encoded update that does not fit the global weights it claims to be relative to."""


def encode_update(new: Mapping[str, Tensor], base: Mapping[str, Tensor], encoding: str) -> bytes:
    """`new - base` per floating tensor in `encoding`; other tensors (counters) as they are. Deflated."""
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
            scale = delta.abs().max() / 127.0
            scale = scale if scale > 0 else torch.tensor(1.0)
            out[name] = torch.round(delta / scale).clamp_(-127, 127).to(torch.int8)
            out[name + SCALE_SUFFIX] = scale.reshape(1).float()
    return zlib.compress(state_dict_to_bytes(out, metadata={"encoding": encoding}), 6)


def decode_update(data: bytes, base: Mapping[str, Tensor], encoding: str) -> dict[str, Tensor]:
    """The full new state (`base + delta`, in base's dtypes) from `encode_update`'s bytes."""
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(data, MAX_INFLATED_BYTES)
        if inflater.unconsumed_tail or not inflater.eof:
            raise BadUpdate("the update is truncated, or expands past the size limit")
    except zlib.error as exc:
        raise BadUpdate(f"the update is not deflated data: {exc}") from None
    encoded = bytes_to_state_dict(raw)
    scales = {k[: -len(SCALE_SUFFIX)]: v for k, v in encoded.items() if k.endswith(SCALE_SUFFIX)}
    tensors = {k: v for k, v in encoded.items() if not k.endswith(SCALE_SUFFIX)}
    if set(tensors) != set(base):
        missing, extra = sorted(set(base) - set(tensors)), sorted(set(tensors) - set(base))
        raise BadUpdate(f"tensor names differ from the global weights: missing {missing[:5]}, unexpected {extra[:5]}")
    expected = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}[encoding]
    state: dict[str, Tensor] = {}
    for name, ref in base.items():
        value = tensors[name]
        if value.shape != ref.shape:
            raise BadUpdate(f"tensor '{name}' has shape {list(value.shape)}; expected {list(ref.shape)}")
        if not ref.is_floating_point():
            if value.dtype != ref.dtype:
                raise BadUpdate(f"tensor '{name}' has dtype {value.dtype}; expected {ref.dtype}")
            state[name] = value
            continue
        if value.dtype != expected:
            raise BadUpdate(f"tensor '{name}' is {value.dtype}; a {encoding} update carries {expected}")
        delta = value.float()
        if encoding == "int8":
            scale = scales.get(name)
            if scale is None or scale.numel() != 1:
                raise BadUpdate(f"tensor '{name}' has no scale")
            delta = delta * scale.float()
        state[name] = (ref.float() + delta).to(ref.dtype)
    return state
