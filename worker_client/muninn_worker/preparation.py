"""From a parsed dataset to the samples a template trains on: pure functions over arrays, no Django.

Tables stay rows of features; images become [rows, channels, height, width] for the image templates (or stay
flat for the MLP); text becomes non-overlapping windows of `context` token ids with their next tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from . import datasets


def parse_options(profile: dict, model_config: dict) -> dict:
    """The parse_dataset options that give the arrays this job trains on (the same at every read)."""
    options: dict = {}
    if profile.get("kind") in ("table", "image") and profile.get("format") != "images":
        options["task"] = profile.get("task")
    if profile.get("format") == "images":
        options["image_size"] = model_config.get("height") or profile["image_shape"][1]
    if profile.get("kind") == "text":
        options["tokenizer"] = profile.get("tokenizer")
    return options


def sample_count(profile: dict, model_config: dict) -> int:
    """How many training samples (rows, images or text windows) the dataset gives this model."""
    if profile.get("kind") == "text":
        return datasets.window_count(profile["tokens"], model_config["context"])
    return int(profile["rows"])


def decoded_too_large(profile: dict, model_config: dict, rows: int) -> str | None:
    """A zip of images is decoded at the template's size: say so when that would not fit the limit."""
    if profile.get("format") != "images":
        return None
    channels, side = profile["image_shape"][0], model_config.get("height", profile["image_shape"][1])
    elements = rows * channels * side * side
    if elements <= datasets.images.MAX_DECODED_ELEMENTS:
        return None
    return (f"{rows} images of {channels}x{side}x{side} would take {elements * 4 / 2**30:.1f} GiB decoded; the "
            f"limit is {datasets.images.MAX_DECODED_ELEMENTS * 4 / 2**30:.2f} GiB. Choose a smaller image_size.")


def samples(parsed: datasets.ParsedDataset, model_config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(X, y) tensors, one sample per row, shaped for the model."""
    profile = parsed.profile
    if profile["kind"] == "text":
        X, y = datasets.windows(parsed.X, model_config["context"])
        return torch.from_numpy(np.ascontiguousarray(X)), torch.from_numpy(np.ascontiguousarray(y))
    X = torch.from_numpy(parsed.X)
    y = torch.from_numpy(parsed.y)
    if "channels" in model_config:  # an image template: [rows, channels, height, width]
        c, h, w = model_config["channels"], model_config["height"], model_config["width"]
        if profile.get("channels_last"):
            X = X.reshape(len(X), h, w, c).permute(0, 3, 1, 2)
        X = X.reshape(len(X), c, h, w)
    else:
        X = X.reshape(len(X), -1)
    return X.contiguous(), y.contiguous()


def job_metadata(profile: dict) -> dict:
    """What the customer needs to use the trained model, kept with the job (classes, target, vocabulary)."""
    if profile.get("kind") == "text":
        return {"tokenizer": profile.get("tokenizer"), "vocab": profile.get("vocab")}
    if profile.get("task") == "regression":
        return {"target": profile.get("target"), "target_stats": profile.get("target_stats")}
    return {"classes": profile.get("classes", [])}
