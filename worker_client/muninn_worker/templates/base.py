"""What every model template is: its hyper-parameters with bounds, its model_config, and the errors.

A template is a frozen description (the registry lists them for the UI and the API) with a few methods:
`build` makes the torch module from a model_config, `model_config` derives that config from a dataset
profile and the chosen hyper-parameters, `fit_state` fills data-derived buffers (normalisation) into the
initial weights, and `example_batch` makes a random batch of the right shapes for FLOP counting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

__all__ = [
    "HParam", "Template", "UnknownTemplate", "InvalidHParams", "InvalidModelConfig", "IncompatibleData",
    "TASK_METRICS", "config_int", "config_keys", "check_hparams",
]

# The metric each task reports on the held-out split, and whether higher is better.
TASK_METRICS = {"classification": ("accuracy", True), "regression": ("rmse", False),
                "language_model": ("perplexity", False)}


class UnknownTemplate(ValueError):
    """The template name is not in the zoo (e.g. a newer site than this client)."""


class InvalidHParams(ValueError):
    """A hyper-parameter is unknown, of the wrong type, or out of bounds. `field` names it."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidModelConfig(ValueError):
    """A model_config does not describe a model this template can build."""


class IncompatibleData(ValueError):
    """The dataset cannot be trained by this template (e.g. text for an image model), said in a sentence."""


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
    """A model family the platform can train. Subclasses implement the methods below.

    `tasks` lists what it can learn (the first is `task`, shown in the registry); `data` the dataset kinds it
    takes ("table", "image", "text"); `tier` is "any" or "gpu" (too heavy for CPUs in practice);
    `optimizer` is "sgd" (with momentum) or "adam"; `needs_base` says the job needs uploaded base weights.
    """

    name: str
    title: str
    description: str
    tasks: tuple[str, ...]
    data: tuple[str, ...]
    hparams: tuple[HParam, ...]
    tier: str = "any"
    optimizer: str = "sgd"
    needs_base: bool = False

    @property
    def task(self) -> str:
        return self.tasks[0]

    def build(self, model_config: dict) -> nn.Module:
        raise NotImplementedError

    def example_batch(self, model_config: dict, batch_size: int, *, seed: int = 0) -> tuple[Tensor, Tensor]:
        """A random (inputs, targets) batch of the right shapes and dtypes, for FLOP counting and benchmarks."""
        raise NotImplementedError

    def model_config(self, profile: dict, hparams: dict) -> dict:
        """The model_config for a dataset with this profile (see muninn_worker/datasets) and checked hparams."""
        raise NotImplementedError

    def fit_state(self, state: dict[str, Tensor], X: Tensor, y: Tensor) -> dict[str, Tensor]:
        """Fill data-derived buffers of the initial weights from the training split; default: none."""
        return state

    def task_of(self, model_config: dict) -> str:
        return model_config.get("task", self.task)

    def describe(self) -> dict:
        """The registry entry the UI and the API list."""
        return {
            "name": self.name, "title": self.title, "description": self.description, "task": self.task,
            "tasks": list(self.tasks), "data": list(self.data), "tier": self.tier, "optimizer": self.optimizer,
            "needs_base_weights": self.needs_base,
            "metrics": {task: TASK_METRICS[task][0] for task in self.tasks},
            "hparams": [{"name": h.name, "kind": h.kind,
                         "default": list(h.default) if isinstance(h.default, tuple) else h.default,
                         "minimum": h.minimum, "maximum": h.maximum, "help": h.help,
                         **({"max_items": h.max_items} if h.max_items is not None else {})}
                        for h in self.hparams],
        }


def config_keys(name: str, model_config: Any, required: set[str], optional: set[str] = frozenset()) -> None:
    if not isinstance(model_config, dict) or not required <= set(model_config) <= required | optional:
        got = sorted(model_config) if isinstance(model_config, dict) else type(model_config).__name__
        extra = f" (optional: {sorted(optional)})" if optional else ""
        raise InvalidModelConfig(f"{name} model_config needs exactly the keys {sorted(required)}{extra} (got {got})")


def config_int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidModelConfig(f"{name} must be an integer between {low} and {high} (got {value!r})")
    return value


# ------------------------------------------------------------------------------ hyper-parameter checks


def check_hparams(spec: Template, hparams: Any) -> dict:
    """A complete, checked copy of `hparams`: defaults filled, unknown keys and bad values rejected."""
    if not isinstance(hparams, dict):
        raise InvalidHParams(f"hyper-parameters must be an object (got {type(hparams).__name__})")
    known = {hp.name: hp for hp in spec.hparams}
    unknown = sorted(set(hparams) - set(known))
    if unknown:
        raise InvalidHParams(
            f"unknown hyper-parameter {unknown[0]!r} for template {spec.name!r} "
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


def train_hparams(epochs: int, batch_size: int, lr: float, *, lr_min: float = 1e-5, lr_max: float = 10.0,
                  momentum: float | None = 0.9, max_epochs: int = 50) -> tuple[HParam, ...]:
    """The training hyper-parameters every template has (momentum only for SGD templates)."""
    common = (
        HParam("epochs", "int", epochs, 1, max_epochs, "Local epochs each device trains per round."),
        HParam("batch_size", "int", batch_size, 1, 4096, "Samples per optimizer step."),
        HParam("lr", "float", lr, lr_min, lr_max, "Learning rate."),
    )
    if momentum is None:
        return common
    return common + (HParam("momentum", "float", momentum, 0.0, 0.999, "SGD momentum."),)
