"""Bytes on the wire, as docs/worker-protocol.md ("Bytes and hashes", the result endpoint) states them: the
canonical safetensors bytes every commitment hashes (written here by hand from the document's layout, so a
wrong description fails the site's hash checks), checkpoint files, and the update codec.

Written from the document alone: nothing here comes from the reference client (muninn_worker)."""
from __future__ import annotations

import hashlib
import json
import struct
import zlib

import torch
from safetensors.torch import load as safetensors_load

# The document's dtype order (widest first as the safetensors serializer lays them out) and names.
DTYPE_ORDER = ["I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL"]
DTYPE_NAMES = {torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32",
               torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16", torch.int8: "I8",
               torch.uint8: "U8", torch.bool: "BOOL"}


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The canonical safetensors bytes: tensors ordered by dtype (DTYPE_ORDER) then by name (byte order), a
    compact JSON header (an `__metadata__` entry only when there is metadata, first) padded with spaces to a
    multiple of 8, then each tensor's raw little-endian C-order bytes, back to back."""
    ordered = sorted(tensors.items(), key=lambda kv: (DTYPE_ORDER.index(DTYPE_NAMES[kv[1].dtype]),
                                                      kv[0].encode()))
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    chunks, offset = [], 0
    for name, tensor in ordered:
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def parse(data: bytes) -> dict[str, torch.Tensor]:
    return safetensors_load(bytes(data))


def commitment(weights: dict[str, torch.Tensor], optimizer: dict[str, torch.Tensor]) -> list[str]:
    """A boundary's commitment: [sha256 of the weights' canonical bytes, sha256 of the optimizer state's]."""
    return [sha256_hex(canonical_bytes(weights)), sha256_hex(canonical_bytes(optimizer))]


def checkpoint_file(weights: dict[str, torch.Tensor], optimizer: dict[str, torch.Tensor]) -> bytes:
    """One safetensors file: the weights under weights/<name>, the optimizer state under optimizer/<name>."""
    merged = {f"weights/{k}": v for k, v in weights.items()}
    merged.update({f"optimizer/{k}": v for k, v in optimizer.items()})
    return canonical_bytes(merged)


def _deltas(trained: dict[str, torch.Tensor], global_: dict[str, torch.Tensor], encoding: str
            ) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, value in trained.items():
        if not value.is_floating_point():
            out[name] = value
            continue
        delta = value.to(torch.float32) - global_[name].to(torch.float32)
        if encoding == "fp32":
            out[name] = delta
        elif encoding == "fp16":
            out[name] = delta.to(torch.float16)
        elif encoding == "int8":
            scale = delta.abs().max() / 127.0 if delta.numel() else torch.tensor(0.0)
            if not scale > 0:
                scale = torch.tensor(1.0)
            out[name] = torch.round(delta / scale).clamp(-127, 127).to(torch.int8)
            out[f"{name}.__scale__"] = scale.reshape(1).to(torch.float32)
        else:
            raise ValueError(f"unknown encoding {encoding!r}")
    return out


def encode_update(trained: dict[str, torch.Tensor], global_: dict[str, torch.Tensor], encoding: str) -> bytes:
    """The upload: the encoded deltas as safetensors with metadata {"encoding": ...}, in a zlib stream."""
    return zlib.compress(canonical_bytes(_deltas(trained, global_, encoding), {"encoding": encoding}))


def decode_update(data: bytes, global_: dict[str, torch.Tensor], encoding: str) -> dict[str, torch.Tensor]:
    """The full state the site makes of an upload: global + delta per floating tensor, in float32, then cast to
    the global tensor's dtype; other tensors as uploaded."""
    encoded = parse(zlib.decompress(data))
    state = {}
    for name, ref in global_.items():
        if not ref.is_floating_point():
            state[name] = encoded[name]
            continue
        delta = encoded[name].to(torch.float32)
        if encoding == "int8":
            delta = delta * encoded[f"{name}.__scale__"].to(torch.float32)
        state[name] = (ref.to(torch.float32) + delta).to(ref.dtype)
    return state
