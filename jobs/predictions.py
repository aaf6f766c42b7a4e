"""Predictions from a succeeded job's model, on the site: the same package and loader the customer downloads.

The model file GET /api/jobs/<id>/model serves is loaded with `muninn_worker.load_model` (kept per process,
by the weights' hash) and asked exactly as a customer's own Python would, so the site and the download agree
to the bit. Input is bounded (MUNINN_PREDICT_MAX_ROWS rows, MUNINN_PREDICT_MAX_BYTES of file, at most
MUNINN_PREDICT_MAX_LENGTH generated tokens), which bounds the time a request computes: a batch larger than
that is predicted with the downloaded package. Bad input is the upload's kind of error: which row, which
column, what to fix.
"""
from __future__ import annotations

import csv
import io
import threading
from collections import OrderedDict

from django.conf import settings
from muninn_worker import package

from muninn.errors import InvalidInput, TooLarge

from . import selectors
from .models import Job

_CACHE: OrderedDict[tuple[int, str], package.Model] = OrderedDict()
_CACHE_SIZE = 8
_LOCK = threading.Lock()


def job_predictor(job: Job) -> package.Model:
    """The job's model as its package loads it (a LoRA job's merged model), cached by its weights."""
    key = (job.pk, job.global_weights_sha256)
    with _LOCK:
        model = _CACHE.get(key)
        if model is not None:
            _CACHE.move_to_end(key)
            return model
    model_file = selectors.job_model_file(job, artefact="merged" if job.base_weights_id else "model")
    model = package.load_model(model_file.data)
    with _LOCK:
        _CACHE[key] = model
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return model


def job_predict(job: Job, *, rows=None, text: str | None = None, data: bytes | None = None, filename: str = "",
                prompt: str | None = None, length: int | None = None, temperature: float = 0.0,
                seed: int = 0) -> dict:
    """Predictions for one of: `rows` (a list of {column: value}, or of numbers for an .npz table), `text`
    (CSV), `data` (an uploaded file: CSV, an image, a zip of images, an .npz), or `prompt` (a language
    model, continued by `length` tokens). {"task", "predictions": [...]} or {"task", "prompt", "text"}."""
    model = job_predictor(job)
    given = [name for name, value in (("rows", rows), ("csv", text), ("file", data), ("prompt", prompt))
             if value is not None]
    if len(given) != 1:
        wants = "a prompt" if model.spec["kind"] == "text" else _wants(model)
        raise InvalidInput(f"Give exactly one input: {wants}." + (f" Got {', '.join(given)}." if given else ""),
                           code="bad_input")
    if data is not None and len(data) > settings.MUNINN_PREDICT_MAX_BYTES:
        raise TooLarge(f"The file is {len(data):,} bytes; predictions on the site take at most "
                       f"{settings.MUNINN_PREDICT_MAX_BYTES:,}. Download the model package to predict on more.")
    try:
        if model.spec["kind"] == "text":
            return _generate(model, prompt, length, temperature, seed, given[0])
        if prompt is not None:
            raise package.DatasetError("bad_input", f"This model predicts from {_wants(model)}, not a prompt.")
        inputs, labels = model.encode(next(v for v in (rows, text, data) if v is not None), name=filename or "input")
        if len(labels) > settings.MUNINN_PREDICT_MAX_ROWS:
            raise TooLarge(f"{len(labels):,} rows; predictions on the site take at most "
                           f"{settings.MUNINN_PREDICT_MAX_ROWS:,} per request. Split the file, or download the "
                           "model package and predict locally.", code="too_many_rows")
        return {"task": model.task, "predictions": model.answer(inputs, labels)}
    except package.DatasetError as e:
        raise InvalidInput(e.message, code=e.code, detail=e.detail) from e


def _generate(model, prompt, length, temperature, seed, given: str) -> dict:
    if prompt is None:
        raise package.DatasetError("bad_input", f"This is a language model: give a prompt, not {given}.")
    length = 100 if length is None else length
    if not isinstance(length, int) or isinstance(length, bool) or not 1 <= length <= settings.MUNINN_PREDICT_MAX_LENGTH:
        raise package.DatasetError("bad_length", f"length must be a whole number from 1 to "
                                   f"{settings.MUNINN_PREDICT_MAX_LENGTH}.", length=str(length)[:20])
    text = model.generate(prompt, length, temperature=temperature, seed=seed)
    return {"task": model.task, "prompt": prompt, "text": text}


def _wants(model: package.Model) -> str:
    if model.spec["kind"] == "table":
        return "rows (CSV text, a CSV file, or a list of {column: value})"
    if model.spec["format"] == "images":
        return "an image (PNG or JPEG) or a zip of images"
    return "rows of numbers or an .npz with an array X"


def predictions_csv(answer: dict) -> str:
    """The predictions as a CSV a spreadsheet opens: row, prediction, and each class's probability."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    predictions = answer["predictions"]
    if answer["task"] == "regression":
        writer.writerow(["row", "prediction"])
        writer.writerows([p["row"], repr(p["value"])] for p in predictions)
        return buffer.getvalue()
    classes = list(predictions[0]["probabilities"]) if predictions else []
    writer.writerow(["row", "prediction", *(f"p({c})" for c in classes)])
    writer.writerows([p["row"], p["label"], *(repr(p["probabilities"][c]) for c in classes)] for p in predictions)
    return buffer.getvalue()


def try_panel(job: Job) -> dict | None:
    """What the job page's "Try the model" panel asks for, or None before the job has a model."""
    if job.status != Job.Status.SUCCEEDED:
        return None
    profile = job.dataset.profile
    kind = profile.get("kind")
    panel = {"kind": "image" if kind == "image" and profile.get("format") == "images" else kind,
             "max_rows": settings.MUNINN_PREDICT_MAX_ROWS, "max_length": settings.MUNINN_PREDICT_MAX_LENGTH}
    if kind == "table":
        names = [c["name"] for c in profile.get("columns", [])] or [f"x{j}" for j in range(profile["features"])]
        panel["header"] = ",".join(names)
    elif kind == "image" and profile.get("format") != "images":
        panel["kind"] = "arrays"  # an .npz of images: rows of numbers, through the API or the package
    return panel
