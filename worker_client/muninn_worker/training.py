"""Local training of one work unit: SGD with momentum (or Adam, for transformers) on the task's loss.

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
from torch import Tensor, nn

from muninn_worker import tasks

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
    momentum: float = 0.0,
    seed: int,
    optimizer: str = "sgd",
    inner_steps: int | None = None,
    progress: ProgressFn | None = None,
) -> TrainResult:
    """Train `model` in place on (X, y) and return its new weights with the numbers a receipt needs.

    The last batch of an epoch may be smaller than `batch_size`, so steps = epochs * ceil(samples / batch).
    `progress` may raise to abort training (the runner does when its lease is lost). The task (and so the
    loss) is the model's `task`: see `muninn_worker.tasks`. `optimizer` is "sgd" (with `momentum`) or "adam".

    `inner_steps` (DiLoCo) replaces epochs: exactly that many steps, each on a batch of min(batch_size, samples)
    drawn from successive shuffles of the shard, so the work is inner_steps × that batch, whatever the shard's
    size; `progress` then reports every ceil(samples / batch) steps (an epoch's worth) and at the end.
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
        opt = _optimizer(optimizer, [p for p in model.parameters() if p.requires_grad], lr, momentum)
        model.train()
        steps = 0
        started = time.perf_counter()
        if inner_steps is None:
            for epoch in range(1, epochs + 1):
                epoch_loss = _train_epoch(model, opt, X, y, batch_size, shuffler)
                steps += math.ceil(samples / batch_size)
                if progress is not None:
                    progress(epoch, epochs, epoch_loss)
        else:
            if inner_steps < 1:
                raise ValueError(f"inner_steps must be at least 1 (got {inner_steps})")
            steps = _train_steps(model, opt, X, y, min(batch_size, samples), inner_steps, shuffler, progress)
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
        loss = tasks.loss(model, model(X[index]), y[index])
        loss.backward()
        optimizer.step()
        total += loss.item() * index.shape[0]
    return total / X.shape[0]


def _train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, X: Tensor, y: Tensor, batch: int,
                 inner_steps: int, shuffler: torch.Generator, progress: ProgressFn | None) -> int:
    """`inner_steps` steps of exactly `batch` samples each, taken in order from back-to-back permutations."""
    per_report = math.ceil(X.shape[0] / batch)
    reports = math.ceil(inner_steps / per_report)
    pool = torch.empty(0, dtype=torch.long)
    total, seen = 0.0, 0
    for step in range(1, inner_steps + 1):
        while pool.shape[0] < batch:
            pool = torch.cat([pool, torch.randperm(X.shape[0], generator=shuffler)])
        index, pool = pool[:batch].to(X.device), pool[batch:]
        optimizer.zero_grad(set_to_none=True)
        loss = tasks.loss(model, model(X[index]), y[index])
        loss.backward()
        optimizer.step()
        total, seen = total + loss.item() * batch, seen + batch
        if progress is not None and (step % per_report == 0 or step == inner_steps):
            progress(math.ceil(step / per_report), reports, total / seen)
            total, seen = 0.0, 0
    return inner_steps


def _optimizer(name: str, params: list, lr: float, momentum: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r} (known: sgd, adam)")


@torch.no_grad()
def evaluate(model: nn.Module, X: Tensor, y: Tensor) -> dict[str, float]:
    """The task's metrics of `model` on the whole of (X, y): always "loss" (the training loss), plus
    "accuracy" (classification), "mse" and "rmse" (regression) or "perplexity" (language model)."""
    X, y = _prepare(model, X, y)
    was_training = model.training
    model.eval()
    chunk = max(1, _EVAL_CHUNK // (X.shape[1] if X.ndim == 2 and not X.is_floating_point() else 1))
    totals: dict[str, float] = {}
    try:
        for start in range(0, X.shape[0], chunk):
            stats = tasks.batch_stats(model, model(X[start : start + chunk]), y[start : start + chunk])
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
    finally:
        model.train(was_training)
    return tasks.summarise(tasks.task_of(model), totals)


@torch.no_grad()
def predict(model: nn.Module, X: Tensor) -> Tensor:
    """Predicted class index (int64) for classification, the value (float32) for regression, the next-token id
    at every position for a language model; on CPU."""
    X = _inputs(model, X)
    was_training = model.training
    model.eval()
    regression = tasks.task_of(model) == "regression"
    try:
        chunks = [model(X[i : i + _EVAL_CHUNK]) for i in range(0, X.shape[0], _EVAL_CHUNK)]
        chunks = [c if regression else c.argmax(dim=-1) for c in chunks]
    finally:
        model.train(was_training)
    return torch.cat(chunks).cpu() if chunks else torch.empty(0, dtype=torch.long)


def _prepare(model: nn.Module, X: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    task = tasks.task_of(model)
    y_ndim = 2 if task == "language_model" else 1
    if X.ndim < 2 or y.ndim != y_ndim or X.shape[0] != y.shape[0] or X.shape[0] == 0:
        raise ValueError(
            f"need X with one row per sample and a {y_ndim}-d y of the same length (got X {tuple(X.shape)}, "
            f"y {tuple(y.shape)})"
        )
    return _inputs(model, X), y.to(_model_device(model), dtype=tasks.target_dtype(task))


def _inputs(model: nn.Module, X: Tensor) -> Tensor:
    """Token ids stay integers; everything else takes the model's float dtype."""
    if tasks.task_of(model) == "language_model":
        return X.to(_model_device(model), dtype=torch.long)
    return X.to(_model_device(model), dtype=_model_dtype(model))


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _detached_state(model: nn.Module) -> dict[str, Tensor]:
    # clone(): the returned tensors must not alias the live model, which the caller may keep training.
    return {key: value.detach().to("cpu").clone().contiguous() for key, value in model.state_dict().items()}
