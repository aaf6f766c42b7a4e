"""A round's shards as the protocol sends them, many at once: pure byte arithmetic over one X / y pair.

`tensors.shard_to_bytes` (the worker client's, so both sides agree on the format) costs safetensors' per-call
overhead, ~75 µs a shard: most of the opening of a round cut into 10,000 shards. Here the tensors' order and
dtype names come from it once (a one-row shard), each shard's header is written here, and its data is a slice
of each tensor's bytes: the same bytes, byte for byte (tests/test_round_open.py), in ~3 µs a shard.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import torch
from muninn_worker import tensors


def shards_to_bytes(X: torch.Tensor, y: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> list[bytes]:
    """`tensors.shard_to_bytes(X[start:stop], y[start:stop])` for each (start, stop) of `bounds`."""
    if not bounds:
        return []
    probe = tensors.shard_to_bytes(X[:1], y[:1])
    (probe_len,) = struct.unpack("<Q", probe[:8])
    layout = json.loads(probe[8:8 + probe_len])  # in safetensors' order, which the data follows
    if set(layout) != {"X", "y"}:  # a format this does not know: the slow way
        return [tensors.shard_to_bytes(X[start:stop], y[start:stop]) for start, stop in bounds]
    given, data, row_bytes, tails = {"X": X, "y": y}, {}, {}, {}
    for name in layout:  # as shard_to_bytes sends them: floating as float32, integer as int64
        array = given[name].to(torch.float32 if given[name].is_floating_point() else torch.int64).contiguous()
        data[name] = memoryview(array.numpy()).cast("B")
        row_bytes[name] = len(data[name]) // len(array) if len(array) else 0
        tails[name] = "".join(f",{n}" for n in array.shape[1:])
    out = []
    for start, stop in bounds:
        rows, offset, entries, chunks = stop - start, 0, [], []
        for name in layout:
            size = rows * row_bytes[name]
            entries.append(f'"{name}":{{"dtype":"{layout[name]["dtype"]}","shape":[{rows}{tails[name]}],'
                           f'"data_offsets":[{offset},{offset + size}]}}')
            chunks.append(data[name][start * row_bytes[name]:stop * row_bytes[name]])
            offset += size
        header = ("{" + ",".join(entries) + "}").encode()
        header += b" " * (-len(header) % 8)  # safetensors pads its header to 8 bytes with spaces
        out.append(b"".join([struct.pack("<Q", len(header)), header, *chunks]))
    return out


def pack(blobs: Sequence[bytes]) -> tuple[bytes, list[int]]:
    """The blobs one after another, and the offset each starts at: a round's shards as one file."""
    offsets, at = [], 0
    for blob in blobs:
        offsets.append(at)
        at += len(blob)
    return b"".join(blobs), offsets
