"""The model a customer downloads, usable anywhere: weights plus everything that turns raw input into predictions.

A Muninn model file is one safetensors file. Besides the weights its metadata holds the template and
model_config (`muninn_template`, `muninn_model_config`) and the preprocessing (`muninn_preprocess`, JSON): the
dataset's kind and format, and for a CSV table each column as training encoded it (numeric with the median
that filled its missing cells, or categorical with its one-hot vocabulary), the class names or the target's
statistics, an image job's channels and side, a text job's tokenizer and vocabulary. The normalisation the
model learned from (means, standard deviations) is inside the weights as buffers.

    >>> from muninn_worker import load_model
    >>> model = load_model("muninn-job-12-mlp.safetensors")
    >>> model.predict("age,colour\\n41,red\\n,blue\\n")       # CSV text, a list of dicts, or a DataFrame
    [{'row': 2, 'label': 'yes', 'probabilities': {'no': 0.12, 'yes': 0.88}}, ...]
    >>> model.predict(open("cat.png", "rb").read())             # an image job: one image, or a zip of them
    >>> model.generate("Once upon a time", length=100)           # a language model

The site's predictions (POST /api/jobs/<id>/predict) run this very code on the same file, so they agree
exactly. Input is encoded with the functions that read the training upload (muninn_worker.datasets), so a new
row is encoded as a training row was. Errors are `datasets.DatasetError`, naming the row and column.
"""
from __future__ import annotations

import csv
import io
import json
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import datasets, preparation, tensors, zoo
from .datasets import DatasetError
from .datasets.csv_tables import encode_table
from .datasets.images import decode_for_model

__all__ = ["Model", "load_model", "preprocess_spec", "DatasetError", "MAX_ROWS", "MAX_GENERATE"]

SPEC_VERSION = 1
MAX_ROWS = 100_000  # per call of predict: split larger inputs
MAX_GENERATE = 2_000  # tokens per call of generate
_CHUNK = 4096


def preprocess_spec(profile: dict, template: str, model_config: dict) -> dict:
    """What the model file must carry to preprocess raw input as training did (its `muninn_preprocess`)."""
    kind, fmt = profile.get("kind"), profile.get("format")
    spec: dict = {"version": SPEC_VERSION, "kind": kind, "format": fmt,
                  "task": zoo.task_of(template, model_config)}
    if kind == "text":
        spec.update(tokenizer=profile["tokenizer"], vocab=profile.get("vocab"), context=model_config["context"])
        return spec
    if spec["task"] == "regression":
        spec.update(target=profile.get("target"), target_stats=profile.get("target_stats"))
    else:
        spec.update(target=profile.get("target"), classes=list(profile.get("classes", [])))
    if kind == "table":
        spec["columns"] = profile["columns"] if fmt == "csv" else [
            {"name": f"x{j}", "type": "numeric"} for j in range(profile["features"])]
    elif fmt == "images":
        channels = profile["image_shape"][0]
        spec.update(channels=channels, side=model_config.get("height") or profile["image_shape"][1])
    else:  # images in an .npz: arrays of numbers, laid out as the upload's were
        spec.update(input_shape=profile.get("input_shape"), channels_last=bool(profile.get("channels_last")))
    return spec


@dataclass
class Model:
    """A trained Muninn model with its preprocessing. `predict` takes raw input, `generate` continues text."""

    template: str
    model_config: dict
    spec: dict
    module: torch.nn.Module
    job: str = ""

    @property
    def task(self) -> str:
        return self.spec["task"]

    @property
    def classes(self) -> list[str]:
        return list(self.spec.get("classes", []))

    # --- input --------------------------------------------------------------------------------------------
    def encode(self, data, *, name: str = "input") -> tuple[torch.Tensor, list]:
        """Raw input as the model's input tensor, with each sample's label for messages (row number, file)."""
        kind = self.spec["kind"]
        if kind == "text":
            raise DatasetError("bad_input", "A language model continues a prompt: use generate(prompt, length).")
        if kind == "table":
            X, rows = self._table(data)
        elif self.spec["format"] == "images":
            X, rows = self._images(data, name)
        else:
            X, rows = self._arrays(data)
        parsed = datasets.ParsedDataset(X=X, y=np.zeros(len(X), dtype=np.int64), feature_names=[], classes=[],
                                        profile={"kind": kind, "channels_last": self.spec.get("channels_last")})
        inputs, _ = preparation.samples(parsed, self.model_config)
        return inputs, rows

    def _table(self, data) -> tuple[np.ndarray, list]:
        columns = self.spec["columns"]
        if isinstance(data, os.PathLike):
            data = Path(data).read_bytes()
        if isinstance(data, bytes) and data.startswith(datasets.common.ZIP_MAGIC):  # an .npz of rows
            return self._numbers(_npz_X(data).astype(np.float64))
        if isinstance(data, bytes):
            data = datasets.common.decode_utf8(data, fix="Save the file as UTF-8 and try again.")
        if hasattr(data, "to_dict"):  # a pandas DataFrame
            data = data.to_dict("records")
        if isinstance(data, Mapping):
            data = [data]
        if isinstance(data, str):
            return encode_table(data, columns, max_rows=MAX_ROWS)
        if isinstance(data, np.ndarray) or _number_rows(data):
            return self._numbers(np.asarray(data, dtype=np.float64))
        return encode_table(_records_csv(data), columns, max_rows=MAX_ROWS, first_row=1)

    def _numbers(self, X: np.ndarray) -> tuple[np.ndarray, list]:
        """Rows of plain numbers: only for a model whose columns are all numeric (an .npz table), in order."""
        columns = self.spec["columns"]
        if any(c["type"] != "numeric" for c in columns) or self.spec["format"] == "csv":
            raise DatasetError("bad_input", "Give rows as CSV text or as a list of {column: value} objects: the "
                               "model's columns are " + ", ".join(repr(c["name"]) for c in columns[:20]) + ".")
        X = X.reshape(1, -1) if X.ndim == 1 else X
        if X.ndim != 2 or X.shape[1] != len(columns):
            raise DatasetError("bad_shape", f"Each row needs {len(columns)} numbers; got shape {list(X.shape)}.",
                               shape=list(X.shape), features=len(columns))
        _check_rows(len(X))
        _check_finite(X)
        return X.astype(np.float32), list(range(1, len(X) + 1))

    def _images(self, data, name: str) -> tuple[np.ndarray, list]:
        if isinstance(data, (os.PathLike, str)):
            name, data = Path(data).name, Path(data).read_bytes()
        if not isinstance(data, (bytes, bytearray)):
            raise DatasetError("bad_input", "Give an image as PNG or JPEG bytes or a path (or a zip of images).")
        return decode_for_model(bytes(data), name, size=self.spec["side"], grey=self.spec["channels"] == 1)

    def _arrays(self, data) -> tuple[np.ndarray, list]:
        if isinstance(data, (bytes, bytearray)):
            data = _npz_X(bytes(data))
        X = np.asarray(data, dtype=np.float64)
        shape = list(self.spec["input_shape"])
        if list(X.shape) == shape:
            X = X[None]
        if list(X.shape[1:]) != shape:
            raise DatasetError("bad_shape", f"Each sample must have shape {shape}, as in training; got "
                               f"{list(X.shape)}.", shape=list(X.shape), expected=shape)
        _check_rows(len(X))
        _check_finite(X.reshape(len(X), -1))
        return X.reshape(len(X), -1).astype(np.float32), list(range(len(X)))

    # --- output -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def outputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """The module's raw outputs (logits or values) on an input tensor, in chunks."""
        self.module.eval()
        return torch.cat([self.module(inputs[i:i + _CHUNK]) for i in range(0, len(inputs), _CHUNK)])

    def predict(self, data, *, name: str = "input") -> list[dict]:
        """Predictions for raw input: per sample {"row", "label", "probabilities"} (classification) or
        {"row", "value"} (regression). `row` is the CSV line (as a spreadsheet numbers it), the position in a
        list (from 1), or the image's file name."""
        return self.answer(*self.encode(data, name=name))

    def answer(self, inputs: torch.Tensor, rows: list) -> list[dict]:
        """`predict`'s answer for inputs already encoded (`encode`), one per entry of `rows`."""
        out = self.outputs(inputs)
        if self.task == "regression":
            return [{"row": row, "value": float(v)} for row, v in zip(rows, out.tolist())]
        probabilities = torch.softmax(out.to(torch.float32), dim=-1)
        classes = self.classes
        return [{"row": row, "label": classes[int(p.argmax())],
                 "probabilities": dict(zip(classes, p.tolist()))} for row, p in zip(rows, probabilities)]

    @torch.no_grad()
    def generate(self, prompt: str, length: int = 100, *, temperature: float = 0.0, seed: int = 0) -> str:
        """The prompt continued by `length` tokens: the most likely token each step (temperature 0) or
        sampled at `temperature` with `seed` (the same seed, the same text)."""
        if self.spec["kind"] != "text":
            raise DatasetError("bad_input", "Only a language model generates text; use predict(rows).")
        if not isinstance(length, int) or not 1 <= length <= MAX_GENERATE:
            raise DatasetError("bad_length", f"length must be a whole number from 1 to {MAX_GENERATE}.",
                               length=str(length)[:20])
        if not isinstance(temperature, (int, float)) or not 0 <= temperature <= 10:
            raise DatasetError("bad_temperature", "temperature must be a number from 0 (most likely) to 10.")
        ids = self._tokens(prompt)
        context = self.spec["context"]
        generator = torch.Generator().manual_seed(int(seed))
        self.module.eval()
        out = list(ids)
        for _ in range(length):
            logits = self.module(torch.tensor([out[-context:]], dtype=torch.int64))[0, -1].to(torch.float32)
            if temperature == 0:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator))
            out.append(token)
        return self._text(out[len(ids):])

    def _tokens(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError("bad_prompt", "Give a prompt: some text for the model to continue.")
        if self.spec["tokenizer"] == "byte":
            return list(prompt.encode("utf-8"))
        index = {c: i for i, c in enumerate(self.spec["vocab"])}
        for position, char in enumerate(prompt):
            if char not in index:
                raise DatasetError("bad_prompt", f"character {position + 1} of the prompt, {char!r}, never occurs "
                                   "in the training text, so the model has no token for it.",
                                   position=position + 1, character=char)
        return [index[c] for c in prompt]

    def _text(self, ids: list[int]) -> str:
        if self.spec["tokenizer"] == "byte":
            return bytes(ids).decode("utf-8", errors="replace")
        vocab = self.spec["vocab"]
        return "".join(vocab[i] for i in ids)


def load_model(source: str | os.PathLike | bytes) -> Model:
    """A Muninn model file (a path or its bytes) as a `Model` ready to predict. CPU; no network."""
    data = source if isinstance(source, (bytes, bytearray)) else Path(source).read_bytes()
    data = bytes(data)
    metadata = _metadata(data)
    missing = [key for key in ("muninn_template", "muninn_model_config", "muninn_preprocess") if key not in metadata]
    if missing:
        raise DatasetError("bad_model", "This is not a Muninn model package (its metadata has no "
                           f"{', '.join(missing)}); download the model again from the job page.")
    template, config = metadata["muninn_template"], json.loads(metadata["muninn_model_config"])
    if template == "lora":
        raise DatasetError("bad_model", "This file holds LoRA adapters only; download the merged model "
                           "(GET /api/jobs/<id>/model?artefact=merged) to predict with it.")
    module = zoo.build_model(template, config)
    module.load_state_dict(tensors.bytes_to_state_dict(data))
    module.eval()
    return Model(template=template, model_config=config, spec=json.loads(metadata["muninn_preprocess"]),
                 module=module, job=metadata.get("muninn_job", ""))


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's __metadata__ (read without loading any tensor)."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        return json.loads(data[8:8 + length]).get("__metadata__") or {}
    except (struct.error, ValueError, UnicodeDecodeError):
        raise DatasetError("bad_model", "This is not a safetensors model file.") from None


def _records_csv(records: Iterable) -> str:
    """A list of {column: value} rows as CSV text (None and NaN are missing cells)."""
    records = list(records)
    if not records:
        raise DatasetError("no_rows", "There is nothing to predict: give at least one row.", rows=0)
    if not all(isinstance(r, Mapping) for r in records):
        raise DatasetError("bad_input", "Give rows as a list of {column: value} objects (or as CSV text).")
    names = list(dict.fromkeys(str(k) for r in records for k in r))
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(names)
    for record in records:
        writer.writerow(["" if _missing(record.get(n)) else str(record.get(n)) for n in names])
    return buffer.getvalue()


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and value != value)


def _number_rows(data) -> bool:
    return isinstance(data, (list, tuple)) and bool(data) and all(
        isinstance(r, (list, tuple, int, float)) and not isinstance(r, bool) for r in data)


def _check_rows(n: int) -> None:
    if n == 0:
        raise DatasetError("no_rows", "There is nothing to predict: give at least one row.", rows=0)
    if n > MAX_ROWS:
        raise DatasetError("too_large", f"{n} rows; at most {MAX_ROWS} per call.", rows=n, limit=MAX_ROWS)


def _check_finite(X: np.ndarray) -> None:
    bad = datasets.common.first_nonfinite(X)
    if bad:
        raise DatasetError("bad_number", f"row {bad[0] + 1} holds a value that is not a finite number at feature "
                           f"{bad[1]}.", row=bad[0] + 1, column=bad[1])


def _npz_X(data: bytes) -> np.ndarray:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            return archive["X"]
    except Exception as exc:  # noqa: BLE001 - a damaged or hostile file fails in many ways
        raise DatasetError("unknown_format", f"This is not a readable .npz with an array X ({exc}).") from None
