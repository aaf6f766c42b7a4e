"""The MLP for tables: standardised features, ReLU layers, a classifier or a regression head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .base import HParam, IncompatibleData, InvalidModelConfig, Template, config_int, config_keys, train_hparams

MAX_FEATURES = 1_000_000
MAX_CLASSES = 100_000
MAX_LAYERS = 4
MAX_WIDTH = 4096


class TabularMLP(nn.Module):
    """Fixed (x - mean) / std normalisation, then Linear/ReLU layers, then a Linear head.

    The normalisation lives in buffers, not parameters: the site fills them from the training split, they
    travel in the state_dict with the weights, and local training never changes them. `norm_std` must be
    positive (the site replaces a zero std by 1). A regression head predicts in target units through two
    more buffers (`target_mean`, `target_std`), so the downloaded model answers in the customer's units while
    training sees a standardised target.
    """

    def __init__(self, in_features: int, num_classes: int, hidden: list[int], task: str = "classification") -> None:
        super().__init__()
        self.task = task
        self.register_buffer("norm_mean", torch.zeros(in_features))
        self.register_buffer("norm_std", torch.ones(in_features))
        layers: list[nn.Module] = []
        width = in_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, 1 if task == "regression" else num_classes))
        self.layers = nn.Sequential(*layers)
        if task == "regression":
            self.register_buffer("target_mean", torch.zeros(()))
            self.register_buffer("target_std", torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        out = self.layers((x.flatten(1) - self.norm_mean) / self.norm_std)
        if self.task == "regression":
            return out.squeeze(-1) * self.target_std + self.target_mean
        return out



@dataclass(frozen=True)
class MLPTemplate(Template):
    def build(self, model_config: dict) -> nn.Module:
        in_features, num_classes, hidden, task = _config(model_config)
        return TabularMLP(in_features, num_classes, hidden, task)

    def example_batch(self, model_config: dict, batch_size: int, *, seed: int = 0) -> tuple[Tensor, Tensor]:
        in_features, num_classes, _, task = _config(model_config)
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(batch_size, in_features, generator=generator)
        if task == "regression":
            return inputs, torch.randn(batch_size, generator=generator)
        return inputs, torch.randint(0, num_classes, (batch_size,), generator=generator)

    def model_config(self, profile: dict, hparams: dict) -> dict:
        if profile.get("kind") == "text":
            raise IncompatibleData("The mlp template trains on tables and images, not text; choose transformer.")
        if profile.get("task") == "regression":
            return {"in_features": profile["features"], "hidden": hparams["hidden"], "task": "regression"}
        return {"in_features": profile["features"], "num_classes": profile["num_classes"], "hidden": hparams["hidden"]}

    def fit_state(self, state: dict[str, Tensor], X: Tensor, y: Tensor) -> dict[str, Tensor]:
        X = X.flatten(1).to(torch.float32)
        std = X.std(dim=0)
        state["norm_mean"] = X.mean(dim=0)
        state["norm_std"] = torch.where(std > 1e-6, std, torch.ones_like(std))
        if "target_mean" in state:
            y = y.to(torch.float32)
            state["target_mean"] = y.mean().reshape(())
            target_std = y.std().reshape(()) if y.numel() > 1 else torch.ones(())
            state["target_std"] = torch.where(target_std > 1e-6, target_std, torch.ones(()))
        return state


def _config(model_config: dict) -> tuple[int, int, list[int], str]:
    task = model_config.get("task", "classification") if isinstance(model_config, dict) else None
    if task == "regression":
        config_keys("mlp", model_config, {"in_features", "hidden", "task"})
        num_classes = 1
    elif task == "classification":
        config_keys("mlp", model_config, {"in_features", "num_classes", "hidden"}, {"task"})
        num_classes = config_int(model_config["num_classes"], "num_classes", 2, MAX_CLASSES)
    else:
        raise InvalidModelConfig(f"mlp task must be 'classification' or 'regression' (got {task!r})")
    in_features = config_int(model_config["in_features"], "in_features", 1, MAX_FEATURES)
    hidden = model_config["hidden"]
    if not isinstance(hidden, (list, tuple)) or len(hidden) > MAX_LAYERS:
        raise InvalidModelConfig(f"hidden must be a list of at most {MAX_LAYERS} layer widths")
    widths = [config_int(v, f"hidden[{i}]", 1, MAX_WIDTH) for i, v in enumerate(hidden)]
    return in_features, num_classes, widths, task


MLP = MLPTemplate(
    name="mlp",
    title="Multi-layer perceptron",
    description=(
        "A fully connected network for tables (and flattened small images): standardised features, up to four "
        "hidden ReLU layers, and a softmax classifier or, for a numeric target, a regression head (RMSE). "
        "Fast to train on CPUs."
    ),
    tasks=("classification", "regression"),
    data=("table", "image"),
    hparams=(
        HParam("hidden", "int_list", (128,), 1, MAX_WIDTH,
               "Widths of the hidden layers, e.g. [128] or [256, 128] (at most 4 layers; [] is linear).",
               max_items=MAX_LAYERS),
        *train_hparams(2, 32, 0.05),
    ),
)
