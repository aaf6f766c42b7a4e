"""The model zoo: the one place that says what each model template is.

The site imports this module to list templates, check hyper-parameters, derive model configs from a
dataset's profile, build models, initialise the global weights and count FLOPs; the worker client imports
it to train. Because both sides call the same `build_model`, they always agree on the architecture and on
the state_dict keys, shapes and dtypes. The templates themselves live in `muninn_worker.templates`.
"""

from __future__ import annotations

from torch import Tensor, nn

from muninn_worker.templates import (
    TEMPLATES,
    HParam,
    IncompatibleData,
    InvalidHParams,
    InvalidModelConfig,
    Template,
    UnknownTemplate,
)
from muninn_worker.templates import text as _text
from muninn_worker.templates.base import TASK_METRICS, check_hparams

__all__ = [
    "HParam",
    "Template",
    "TEMPLATES",
    "TASK_METRICS",
    "UnknownTemplate",
    "InvalidHParams",
    "InvalidModelConfig",
    "IncompatibleData",
    "get_template",
    "build_model",
    "init_state",
    "validate_hparams",
    "model_config_for",
    "task_of",
    "load_base",
    "merge_lora",
    "lm_config_from_base",
]


def get_template(template: str) -> Template:
    try:
        return TEMPLATES[template]
    except (KeyError, TypeError):
        known = ", ".join(sorted(TEMPLATES))
        raise UnknownTemplate(f"unknown model template {template!r} (known: {known})") from None


def build_model(template: str, model_config: dict) -> nn.Module:
    """A fresh module for `template`, with torch's default (global-RNG) initialisation."""
    return get_template(template).build(model_config)


def init_state(template: str, model_config: dict, seed: int) -> dict[str, Tensor]:
    """The initial weights for a job: the same seed gives bitwise the same tensors on any machine.

    Forks the RNG so seeding here does not disturb the caller's random stream.
    """
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(template, model_config)
    return {key: value.detach().clone().contiguous() for key, value in model.state_dict().items()}


def validate_hparams(template: str, hparams: dict) -> dict:
    """A complete, checked copy of `hparams`: defaults filled, unknown keys and bad values rejected."""
    return check_hparams(get_template(template), hparams)


def model_config_for(template: str, profile: dict, hparams: dict) -> dict:
    """The model_config for a dataset profile and checked hparams (IncompatibleData when it cannot train it)."""
    return get_template(template).model_config(profile, hparams)


def task_of(template: str, model_config: dict) -> str:
    """"classification", "regression" or "language_model"."""
    return get_template(template).task_of(model_config)


load_base = _text.load_base
merge_lora = _text.merge_lora
lm_config_from_base = _text.lm_config_from_base
