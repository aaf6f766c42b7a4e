"""The model zoo: the one place that says what each model template is.

The site imports this module to build models, initialise the global weights and count FLOPs, and the worker
client imports it to train. Because both sides call the same `build_model`, they always agree on the
architecture and on the state_dict keys, shapes and dtypes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "HParam",
    "Template",
    "TEMPLATES",
    "UnknownTemplate",
    "InvalidHParams",
    "InvalidModelConfig",
    "get_template",
    "build_model",
    "init_state",
    "validate_hparams",
]


class UnknownTemplate(ValueError):
    """The template name is not in the zoo (e.g. a newer site than this client)."""


class InvalidHParams(ValueError):
    """A hyper-parameter is unknown, of the wrong type, or out of bounds. `field` names it."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidModelConfig(ValueError):
    """A model_config does not describe a model this template can build."""


@dataclass(frozen=True)
class HParam:
    """One tunable hyper-parameter, with the bounds the site's form and the validator enforce.

    For kind "int_list", `minimum`/`maximum` bound each item and `max_items` bounds the length. Defaults of
    list kinds are tuples so the frozen dataclass stays hashable; `validate_hparams` returns lists.
    """

    name: str
    kind: str  # "int" | "float" | "int_list"
    default: Any
    minimum: float
    maximum: float
    help: str
    max_items: int | None = None


@dataclass(frozen=True)
class Template:
    """A model family the platform can train. Subclasses implement `build` and `example_batch`."""

    name: str
    title: str
    description: str
    task: str  # "classification"
    hparams: tuple[HParam, ...]

    def build(self, model_config: dict) -> nn.Module:
        raise NotImplementedError

    def example_batch(self, model_config: dict, batch_size: int, *, seed: int = 0) -> tuple[Tensor, Tensor]:
        """A random (inputs, targets) batch of the right shapes, for FLOP counting and benchmarks."""
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------- mlp


class TabularMLP(nn.Module):
    """Fixed (x - mean) / std normalisation, then Linear/ReLU layers, then a Linear classifier head.

    The normalisation lives in buffers, not parameters: the site fills them from the dataset profile, they
    travel in the state_dict with the weights, and local training never changes them. `norm_std` must be
    positive (the site replaces a zero std by 1).
    """

    def __init__(self, in_features: int, num_classes: int, hidden: list[int]) -> None:
        super().__init__()
        self.register_buffer("norm_mean", torch.zeros(in_features))
        self.register_buffer("norm_std", torch.ones(in_features))
        layers: list[nn.Module] = []
        width = in_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers((x - self.norm_mean) / self.norm_std)


_MLP_MAX_FEATURES = 1_000_000
_MLP_MAX_CLASSES = 100_000
_MLP_MAX_LAYERS = 4
_MLP_MAX_WIDTH = 4096


@dataclass(frozen=True)
class MLPTemplate(Template):
    def build(self, model_config: dict) -> nn.Module:
        in_features, num_classes, hidden = _mlp_config(model_config)
        return TabularMLP(in_features, num_classes, hidden)

    def example_batch(self, model_config: dict, batch_size: int, *, seed: int = 0) -> tuple[Tensor, Tensor]:
        in_features, num_classes, _ = _mlp_config(model_config)
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(batch_size, in_features, generator=generator)
        targets = torch.randint(0, num_classes, (batch_size,), generator=generator)
        return inputs, targets


def _mlp_config(model_config: dict) -> tuple[int, int, list[int]]:
    expected = {"in_features", "num_classes", "hidden"}
    if not isinstance(model_config, dict) or set(model_config) != expected:
        got = sorted(model_config) if isinstance(model_config, dict) else type(model_config).__name__
        raise InvalidModelConfig(f"mlp model_config needs exactly the keys {sorted(expected)} (got {got})")
    in_features = _config_int(model_config["in_features"], "in_features", 1, _MLP_MAX_FEATURES)
    num_classes = _config_int(model_config["num_classes"], "num_classes", 2, _MLP_MAX_CLASSES)
    hidden = model_config["hidden"]
    if not isinstance(hidden, (list, tuple)) or len(hidden) > _MLP_MAX_LAYERS:
        raise InvalidModelConfig(f"hidden must be a list of at most {_MLP_MAX_LAYERS} layer widths")
    widths = [_config_int(v, f"hidden[{i}]", 1, _MLP_MAX_WIDTH) for i, v in enumerate(hidden)]
    return in_features, num_classes, widths


def _config_int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidModelConfig(f"{name} must be an integer between {low} and {high} (got {value!r})")
    return value


MLP = MLPTemplate(
    name="mlp",
    title="Multi-layer perceptron",
    description=(
        "A fully connected network for tabular data: standardised numeric features, up to four hidden "
        "ReLU layers, and a softmax classifier. Fast to train on CPUs."
    ),
    task="classification",
    hparams=(
        HParam("hidden", "int_list", (128,), 1, _MLP_MAX_WIDTH,
               "Widths of the hidden layers, e.g. [128] or [256, 128] (at most 4 layers; [] is linear).",
               max_items=_MLP_MAX_LAYERS),
        HParam("epochs", "int", 2, 1, 50, "Local epochs each device trains per round."),
        HParam("batch_size", "int", 32, 1, 4096, "Samples per SGD step."),
        HParam("lr", "float", 0.05, 1e-5, 10.0, "SGD learning rate."),
        HParam("momentum", "float", 0.9, 0.0, 0.999, "SGD momentum."),
    ),
)

TEMPLATES: dict[str, Template] = {MLP.name: MLP}


# ------------------------------------------------------------------------------------ public helpers


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
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(template, model_config)
    return {key: value.detach().clone().contiguous() for key, value in model.state_dict().items()}


def validate_hparams(template: str, hparams: dict) -> dict:
    """A complete, checked copy of `hparams`: defaults filled, unknown keys and bad values rejected."""
    spec = get_template(template)
    if not isinstance(hparams, dict):
        raise InvalidHParams(f"hyper-parameters must be an object (got {type(hparams).__name__})")
    known = {hp.name: hp for hp in spec.hparams}
    unknown = sorted(set(hparams) - set(known))
    if unknown:
        raise InvalidHParams(
            f"unknown hyper-parameter {unknown[0]!r} for template {template!r} "
            f"(known: {', '.join(sorted(known))})",
            field=str(unknown[0]),
        )
    return {name: _check_value(hp, hparams.get(name, hp.default)) for name, hp in known.items()}


def _check_value(hp: HParam, value: Any) -> Any:
    if hp.kind == "int":
        return _check_number(hp.name, value, hp, integer=True)
    if hp.kind == "float":
        return _check_number(hp.name, value, hp, integer=False)
    if hp.kind == "int_list":
        if not isinstance(value, (list, tuple)):
            raise InvalidHParams(f"{hp.name} must be a list of integers (got {value!r})", field=hp.name)
        if hp.max_items is not None and len(value) > hp.max_items:
            raise InvalidHParams(
                f"{hp.name} must have at most {hp.max_items} items (got {len(value)})", field=hp.name
            )
        return [_check_number(f"{hp.name}[{i}]", v, hp, integer=True) for i, v in enumerate(value)]
    raise AssertionError(f"unknown hparam kind {hp.kind!r}")


def _check_number(label: str, value: Any, hp: HParam, *, integer: bool) -> int | float:
    field = hp.name
    # bool is an int subclass; True as a batch size is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        wanted = "an integer" if integer else "a number"
        raise InvalidHParams(f"{label} must be {wanted} (got {value!r})", field=field)
    if not math.isfinite(value) or not hp.minimum <= value <= hp.maximum:
        raise InvalidHParams(
            f"{label} must be between {_fmt(hp.minimum)} and {_fmt(hp.maximum)} (got {value!r})", field=field
        )
    return int(value) if integer else float(value)


def _fmt(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(bound)
