"""Weights and shards on the wire: safetensors only.

Anything that comes from the other side of the trust boundary is parsed with `safetensors.torch.load`,
which cannot run code. `torch.load`/pickle are never used, and bytes that look like a pickle or a
`torch.save` archive are refused with a message that says so.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save
from torch import Tensor

__all__ = [
    "NotSafetensors",
    "BadShard",
    "state_dict_to_bytes",
    "bytes_to_state_dict",
    "shard_to_bytes",
    "bytes_to_shard",
    "sha256_hex",
]

# A safetensors header is JSON; anything claiming a bigger one is garbage, not a model.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class NotSafetensors(ValueError):
    """The bytes are not a safetensors file (a pickle, a torch.save archive, truncated data, ...)."""


class BadShard(ValueError):
    """A shard is safetensors but not an X / y pair the protocol describes (see `bytes_to_shard`)."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def state_dict_to_bytes(sd: dict[str, Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """Serialise a state_dict to safetensors bytes: the same tensors and metadata always give the same bytes."""
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("safetensors metadata must map str to str")
    plain = plain_tensors(sd)
    data = _serialize(plain, metadata) if metadata is None or metadata else None
    if data is not None:
        return data
    data = _st_save(plain, metadata=metadata)
    return _metadata_sorted(data) if metadata else data


# What safetensors.torch.save writes, written here without its per-tensor overhead (numpy arrays, ctypes pointers,
# a search for shared storage: most of the CPU of a small model's save, which every result and every commitment
# runs on both sides of the wire). The bytes must be exactly its own (a checkpoint's hash is a commitment):
# tests/test_worker_tensors.py compares the two on every dtype below, names in any order, empty and 0-d tensors.
# safetensors orders the tensors by dtype, as it ranks them (the widest first), then by name, and pads the JSON
# header with spaces to 8 bytes.
_DTYPES = {torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.uint32: "U32",
           torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint16: "U16", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_RANK = {dtype: rank for rank, dtype in enumerate(_DTYPES)}
_PLAIN_NAME = re.compile(r'[\x20-\x7e]*')  # printable ASCII: JSON writes it as it is, but for " and \


def _serialize(tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> bytes | None:
    """state_dict_to_bytes of plain tensors (plain_tensors): safetensors' bytes, with the metadata's keys sorted
    first (_metadata_sorted); None when a dtype or a name is one this does not write as safetensors would (then
    safetensors writes it)."""
    for name, tensor in tensors.items():
        if tensor.dtype not in _RANK or not _PLAIN_NAME.fullmatch(name) or '"' in name or "\\" in name:
            return None
    entries, chunks, offset = [], [], 0
    if metadata:
        entries.append('"__metadata__":' + json.dumps(dict(sorted(metadata.items())), separators=(",", ":"),
                                                      ensure_ascii=False))
    for name in sorted(tensors, key=lambda k: (_RANK[tensors[k].dtype], k)):
        tensor = tensors[name]
        chunk = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
        end = offset + len(chunk)
        shape = ",".join(str(n) for n in tensor.shape)
        entries.append(f'"{name}":{{"dtype":"{_DTYPES[tensor.dtype]}","shape":[{shape}],'
                       f'"data_offsets":[{offset},{end}]}}')
        chunks.append(chunk)
        offset = end
    header = ("{" + ",".join(entries) + "}").encode()
    header += b" " * (-len(header) % 8)
    return b"".join([struct.pack("<Q", len(header)), header, *chunks])


def _metadata_sorted(data: bytes) -> bytes:
    """The same file with its metadata's keys in sorted order. safetensors writes them in the order of a hash map
    seeded afresh in every process, so the same model gave different bytes from one download to the next (a model
    file's sha256 is certified: jobs/certificates.py). The tensors' entries keep their order and offsets."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    ordered = {"__metadata__": header.pop("__metadata__"), **header}
    text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes, so the tensors stay aligned
    return struct.pack("<Q", len(text)) + text + data[8 + length :]


def bytes_to_state_dict(data: bytes) -> dict[str, Tensor]:
    """Parse safetensors bytes into CPU tensors; raise NotSafetensors for anything else."""
    _check_header(data)
    try:
        return _st_load(bytes(data))
    except Exception as exc:  # safetensors raises its own SafetensorError and sometimes others
        raise NotSafetensors(f"not a valid safetensors file: {exc}") from None


def shard_to_bytes(X: Tensor, y: Tensor) -> bytes:
    """A training shard as the protocol sends it. Floating tensors go as float32, integer ones as int64:

    - tables: X float32 [samples, features]; images: X float32 [samples, channels, height, width];
      y int64 [samples] (class indices) or float32 [samples] (regression targets);
    - text: X int64 [samples, context] token ids and y int64 [samples, context], the next token of each.
    """
    return state_dict_to_bytes({"X": _wire(X), "y": _wire(y)})


def _wire(tensor: Tensor) -> Tensor:
    return tensor.to(torch.float32 if tensor.is_floating_point() else torch.int64)


def bytes_to_shard(data: bytes) -> tuple[Tensor, Tensor]:
    tensors = bytes_to_state_dict(data)
    if set(tensors) != {"X", "y"}:
        raise BadShard(f"a shard holds exactly the tensors X and y (got {sorted(tensors)})")
    X, y = tensors["X"], tensors["y"]
    features = X.dtype == torch.float32 and X.ndim in (2, 4) and y.ndim == 1 and y.dtype in (torch.int64, torch.float32)
    tokens = X.dtype == torch.int64 and X.ndim == 2 and y.dtype == torch.int64 and y.shape == X.shape
    if not (features or tokens):
        raise BadShard(
            "a shard needs X float32 2-d or 4-d with y int64 or float32 1-d, or X and y int64 token ids of "
            f"the same 2-d shape (got X {X.dtype} {tuple(X.shape)}, y {y.dtype} {tuple(y.shape)})"
        )
    if X.shape[0] != y.shape[0]:
        raise BadShard(f"X has {X.shape[0]} rows but y has {y.shape[0]} labels")
    return X, y


def plain_tensors(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Detached, contiguous CPU tensors that share no storage (safetensors refuses shared storage)."""
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for key, value in sd.items():
        if not isinstance(key, str) or not isinstance(value, Tensor):
            raise TypeError(f"state_dict entries must be str -> Tensor (got {key!r}: {type(value).__name__})")
        tensor = value.detach().to("cpu").contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen and tensor.numel() > 0:
            tensor = tensor.clone()
        seen.add(pointer)
        out[key] = tensor
    return out


def _check_header(data: bytes) -> None:
    """Refuse obvious non-safetensors early, with a message that says what the bytes look like.

    The safetensors layout is tried first: a valid header length can itself start like a pickle (a
    640-byte header is 0x80 0x02 ...), so the pickle and zip sniffing only names what failed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise NotSafetensors(f"expected bytes, got {type(data).__name__}")
    head = bytes(data[:8])
    problem = _header_problem(data)
    if problem is None:
        return
    if head.startswith(b"PK\x03\x04"):
        raise NotSafetensors("this is a zip archive (torch.save format), not safetensors; refusing to unpickle")
    if head[:1] == b"\x80" and head[1:2] in {bytes([p]) for p in range(2, 6)}:
        raise NotSafetensors("this is a Python pickle, not safetensors; refusing to unpickle")
    raise NotSafetensors(problem)


def _header_problem(data: bytes) -> str | None:
    if len(data) < 8:
        return f"not safetensors: only {len(data)} bytes"
    (header_len,) = struct.unpack("<Q", bytes(data[:8]))
    if header_len == 0 or header_len > min(_MAX_HEADER_BYTES, len(data) - 8):
        return "not safetensors: the header length does not fit the data"
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]))
    except (UnicodeDecodeError, ValueError):
        return "not safetensors: the header is not JSON"
    if not isinstance(header, dict):
        return "not safetensors: the header is not a JSON object"
    return None
