"""Local training of one work unit: plain SGD with momentum on cross-entropy.

The site uses the same functions to re-execute units for verification, so everything that affects the
result is derived from the `seed` the site hands out: torch's global seed and the shuffling generator.
On CPU the result is bitwise reproducible.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["TrainResult", "ProgressFn", "train_local", "evaluate", "predict"]

ProgressFn = Callable[[int, int, float], None]  # (epoch, epochs, mean training loss of that epoch)

# Full-shard evaluation runs in chunks so a large shard never needs one giant activation tensor.
_EVAL_CHUNK = 8192


@dataclass
class TrainResult:
    state_dict: dict[str, Tensor]
    samples: int
    steps: int
    loss_before: float
    loss_after: float
    train_seconds: float


def train_local(
    model: nn.Module,
    X: Tensor,
    y: Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float,
    seed: int,
    progress: ProgressFn | None = None,
) -> TrainResult:
    """Train `model` in place on (X, y) and return its new weights with the numbers a receipt needs.

    The last batch of an epoch may be smaller than `batch_size`, so steps = epochs * ceil(samples / batch).
    `progress` may raise to abort training (the runner does when its lease is lost).
    """
    X, y = _prepare(model, X, y)
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be at least 1 (got {epochs}, {batch_size})")
    samples = X.shape[0]
    loss_before = evaluate(model, X, y)["loss"]

    # enable_grad: the site may call this from inside a no_grad block (e.g. while verifying).
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(seed)
        shuffler = torch.Generator().manual_seed(seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        model.train()
        steps = 0
        started = time.perf_counter()
        for epoch in range(1, epochs + 1):
            epoch_loss = _train_epoch(model, optimizer, X, y, batch_size, shuffler)
            steps += math.ceil(samples / batch_size)
            if progress is not None:
                progress(epoch, epochs, epoch_loss)
        train_seconds = time.perf_counter() - started

    return TrainResult(
        state_dict=_detached_state(model),
        samples=samples,
        steps=steps,
        loss_before=loss_before,
        loss_after=evaluate(model, X, y)["loss"],
        train_seconds=train_seconds,
    )


def _train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    X: Tensor,
    y: Tensor,
    batch_size: int,
    shuffler: torch.Generator,
) -> float:
    """One pass over a fresh permutation; returns the sample-weighted mean training loss."""
    order = torch.randperm(X.shape[0], generator=shuffler).to(X.device)
    total = 0.0
    for start in range(0, X.shape[0], batch_size):
        index = order[start : start + batch_size]
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(X[index]), y[index])
        loss.backward()
        optimizer.step()
        total += loss.item() * index.shape[0]
    return total / X.shape[0]


@torch.no_grad()
def evaluate(model: nn.Module, X: Tensor, y: Tensor) -> dict[str, float]:
    """Mean cross-entropy and accuracy of `model` on the whole of (X, y)."""
    X, y = _prepare(model, X, y)
    was_training = model.training
    model.eval()
    try:
        loss_sum = 0.0
        correct = 0
        for start in range(0, X.shape[0], _EVAL_CHUNK):
            logits = model(X[start : start + _EVAL_CHUNK])
            targets = y[start : start + _EVAL_CHUNK]
            loss_sum += F.cross_entropy(logits, targets, reduction="sum").item()
            correct += int((logits.argmax(dim=1) == targets).sum().item())
    finally:
        model.train(was_training)
    return {"loss": loss_sum / X.shape[0], "accuracy": correct / X.shape[0]}


@torch.no_grad()
def predict(model: nn.Module, X: Tensor) -> Tensor:
    """Predicted class index (int64, on CPU) for every row of X."""
    X = X.to(_model_device(model), dtype=_model_dtype(model))
    was_training = model.training
    model.eval()
    try:
        chunks = [model(X[i : i + _EVAL_CHUNK]).argmax(dim=1) for i in range(0, X.shape[0], _EVAL_CHUNK)]
    finally:
        model.train(was_training)
    return torch.cat(chunks).cpu() if chunks else torch.empty(0, dtype=torch.long)


def _prepare(model: nn.Module, X: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    if X.ndim < 2 or y.ndim != 1 or X.shape[0] != y.shape[0] or X.shape[0] == 0:
        raise ValueError(
            f"need X with one row per sample and a 1-d y of the same length (got X {tuple(X.shape)}, "
            f"y {tuple(y.shape)})"
        )
    device = _model_device(model)
    return X.to(device, dtype=_model_dtype(model)), y.to(device, dtype=torch.long)


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _detached_state(model: nn.Module) -> dict[str, Tensor]:
    # clone(): the returned tensors must not alias the live model, which the caller may keep training.
    return {key: value.detach().to("cpu").clone().contiguous() for key, value in model.state_dict().items()}
