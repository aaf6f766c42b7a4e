"""Writes on datasets: an upload checked, profiled and stored; a job's training and test splits read back."""
from __future__ import annotations

import io
import logging
from typing import BinaryIO

import torch
from django.conf import settings
from muninn_worker import datasets, preparation, tensors

from muninn.errors import InvalidInput, TooLarge

from .. import sealing, selectors, storage
from ..models import Dataset


log = logging.getLogger(__name__)


def dataset_create(*, owner, filename: str, data: bytes, name: str = "", target: str = "", task: str = "",
                   tokenizer: str = "", sensitive: bool = False) -> Dataset:
    """Validate, profile and store an upload. Nothing is stored unless the whole file is valid.

    `task` forces a table's target to "classification" or "regression" (default: detected); `tokenizer` is
    "char" (default) or "byte" for text. `sensitive`: the data goes only to trusted devices and is sealed at rest
    under a new key of its own (jobs/sealing.py), the upload itself included; it is chosen here, once."""
    if len(data) > settings.MUNINN_MAX_UPLOAD_BYTES:
        raise TooLarge(f"The file is {len(data):,} bytes; the limit is {settings.MUNINN_MAX_UPLOAD_BYTES:,}.")
    if not data:
        raise InvalidInput("The file is empty.", code="empty_file")
    try:
        fmt = datasets.sniff_format(filename, data[:4096])
        parsed = datasets.parse_dataset(data, fmt, target=target or None, task=task or None,
                                        tokenizer=tokenizer or None)
    except datasets.DatasetError as e:
        raise InvalidInput(e.message, code=e.code, detail=e.detail) from e
    if sensitive and fmt == Dataset.Format.WEIGHTS:
        raise InvalidInput("Base weights cannot be marked sensitive: the sensitive tier protects training data. "
                           "Mark the dataset you fine-tune on sensitive instead.", code="sensitive_weights",
                           detail={"field": "sensitive"})
    key = sealing.new_dataset_key() if sensitive else None
    sha = storage.data_put(data, key=key)
    wrapped = None if key is None else sealing.wrap_key(key, site_key=sealing.site_data_key(), label=sha)
    return Dataset.objects.create(
        owner=owner, name=(name or filename)[:200], sha256=sha, size_bytes=len(data), format=fmt,
        target=target, profile=parsed.profile, sensitive=bool(sensitive), wrapped_key=wrapped,
    )


def _load_samples(dataset: Dataset, model_config: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The dataset as (X, y) samples for this model, read exactly as at upload, and the job's metadata."""
    options = preparation.parse_options(dataset.profile, model_config)
    data = storage.data_get(dataset.sha256, key=selectors.dataset_key(dataset))
    parsed = datasets.parse_dataset(data, dataset.format, target=dataset.target or None,
                                    **options)
    X, y = preparation.samples(parsed, model_config)
    return X, y, preparation.job_metadata(parsed.profile)


def _xy_bytes(X: torch.Tensor, y: torch.Tensor) -> bytes:
    return tensors.shard_to_bytes(X.contiguous(), y.contiguous())


def load_xy(sha256: str, *, key: bytes | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A split or shard as (X, y); `key`: its dataset's (selectors.job_data_key), when that is sensitive."""
    return tensors.bytes_to_shard(storage.data_get(sha256, key=key))


def unit_shard_open(unit, *, key: bytes | None) -> BinaryIO:
    """A unit's shard as the device downloads it, as a file to read once: its range of the round's pack, checked
    against the unit's shard_sha256 as it is read (storage.CheckedRange), or its own blob (sealed under `key`, its
    dataset's, when that is sensitive)."""
    if unit.shard_offset is not None:
        return storage.blob_range_open(unit.round.shards_sha256, unit.shard_offset, unit.shard_size,
                                       expect=unit.shard_sha256)
    if key is None:
        return storage.blob_open(unit.shard_sha256)
    return io.BytesIO(storage.data_get(unit.shard_sha256, key=key))


def unit_shard_bytes(unit, *, key: bytes | None) -> bytes:
    """unit_shard_open's bytes (storage.BlobDamaged when the pack's are not the unit's)."""
    with unit_shard_open(unit, key=key) as f:
        return f.read()


def unit_shard_xy(unit) -> tuple[torch.Tensor, torch.Tensor]:
    """A unit's shard as (X, y), opened with its dataset's key when that is sensitive (the site's own checks)."""
    return tensors.bytes_to_shard(unit_shard_bytes(unit, key=selectors.job_data_key(unit.round.job)))
