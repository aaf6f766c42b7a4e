"""What each task optimises and reports: pure functions over a model's outputs and the targets.

classification: cross-entropy; accuracy.  regression: mean squared error of the standardised target
(the model's `target_std` buffer), RMSE in target units.  language_model: cross-entropy per token;
perplexity = exp(mean cross-entropy).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["task_of", "loss", "loss_sum", "sample_count", "batch_stats", "summarise", "target_dtype"]


def task_of(model: nn.Module) -> str:
    return getattr(model, "task", "classification")


def target_dtype(task: str) -> torch.dtype:
    return torch.float32 if task == "regression" else torch.long


def loss(model: nn.Module, output: Tensor, target: Tensor) -> Tensor:
    """The mean training loss of a batch."""
    return loss_sum(model, output, target) / sample_count(task_of(model), target)


def loss_sum(model: nn.Module, output: Tensor, target: Tensor) -> Tensor:
    task = task_of(model)
    if task == "regression":
        scale = model.target_std
        return F.mse_loss(output / scale, target / scale, reduction="sum")
    if task == "language_model":
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1), reduction="sum")
    return F.cross_entropy(output, target, reduction="sum")


def sample_count(task: str, target: Tensor) -> int:
    """What a batch's loss is averaged over: tokens for a language model (a sample is a window), samples otherwise."""
    return target.numel() if task == "language_model" else target.shape[0]


def batch_stats(model: nn.Module, output: Tensor, target: Tensor) -> dict[str, float]:
    """Sums over a batch that `summarise` turns into metrics (so chunked evaluation adds up exactly)."""
    task = task_of(model)
    stats = {"loss_sum": loss_sum(model, output, target).item(), "count": float(sample_count(task, target))}
    if task == "classification":
        stats["correct"] = float((output.argmax(dim=1) == target).sum().item())
    elif task == "regression":
        stats["squared_error"] = float(((output - target) ** 2).sum().item())
    return stats


def summarise(task: str, totals: dict[str, float]) -> dict[str, float]:
    count = totals["count"]
    metrics = {"loss": totals["loss_sum"] / count}
    if task == "classification":
        metrics["accuracy"] = totals["correct"] / count
    elif task == "regression":
        metrics["mse"] = totals["squared_error"] / count
        metrics["rmse"] = math.sqrt(metrics["mse"])
    else:
        metrics["perplexity"] = math.exp(min(metrics["loss"], 700.0))
    return metrics
