"""Local training of one work unit: SGD with momentum (or Adam, for transformers) on the task's loss.

The site re-trains segments of units with the same functions to verify them, so everything that affects the
result comes from what the site hands out: the data order is a function of (seed, step) alone
(`muninn_worker.order`, never torch's CPU or CUDA random streams), and the state at every segment boundary
(weights and optimizer state) can be kept, committed to, and re-trained from (`muninn_worker.segments`). On CPU
the result is bitwise reproducible; on CUDA it is with `deterministic_cuda()`.

`numerics="f64"` trains in float64 and rounds the weights and optimizer state to float32 after every step: a
faithful stand-in for another device's arithmetic (its distances from a float32 CPU run track those of a real
GPU, see shared measurements and bench/verification.py), used by tests and calibration on CPU-only machines.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from muninn_worker import order, tasks
from muninn_worker.segments import Checkpoint

__all__ = ["TrainResult", "ProgressFn", "BoundaryFn", "train_local", "train_segment", "evaluate", "predict",
           "initial_optimizer_state", "deterministic_cuda", "NUMERICS"]

ProgressFn = Callable[[int, int, float], None]  # (epoch, epochs, mean training loss of that epoch)
BoundaryFn = Callable[[int, Checkpoint], None]  # (boundary index, the state there)
NUMERICS = ("native", "f64")

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
    optimizer_state: dict[str, Tensor] = field(default_factory=dict)
    step_losses: list[float] = field(default_factory=list)


def deterministic_cuda() -> None:
    """Make CUDA training reproducible bit for bit on the same kind of GPU: deterministic kernels (cuBLAS needs
    its workspace setting before it starts), no cuDNN autotuning, full fp32 (no TF32: its 10-bit mantissa is
    far past any tolerance)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


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
    segment_steps: int | None = None,
    on_boundary: BoundaryFn | None = None,
    numerics: str = "native",
) -> TrainResult:
    """Train `model` in place on (X, y) and return its new weights with the numbers a receipt needs.

    steps = epochs * ceil(samples / batch) (an epoch's last batch may be short), or exactly `inner_steps`
    (DiLoCo: each step on min(batch_size, samples) rows; see `order.batch_indices`). `progress` is called at
    the end of every epoch (DiLoCo: every ceil(samples / batch) steps) and may raise to abort training (the
    runner does when its lease is lost). `on_boundary(i, checkpoint)` receives the state at boundary i, every
    `segment_steps` steps from the start (boundary 0) to the end (see `muninn_worker.segments`).
    """
    X, y = _prepare(model, X, y)
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be at least 1 (got {epochs}, {batch_size})")
    if inner_steps is not None and inner_steps < 1:
        raise ValueError(f"inner_steps must be at least 1 (got {inner_steps})")
    samples = X.shape[0]
    loss_before = evaluate(model, X, y)["loss"]
    steps = order.total_steps(samples, epochs=epochs, batch_size=batch_size, inner_steps=inner_steps)
    k = segment_steps or steps
    per_report = math.ceil(samples / (batch_size if inner_steps is None else min(batch_size, samples)))
    reports = epochs if inner_steps is None else math.ceil(steps / per_report)
    rows = _Rows(seed=seed, samples=samples, batch_size=batch_size, inner_steps=inner_steps)

    with _Numerics(model, X, numerics) as run, torch.random.fork_rng(devices=[]), torch.enable_grad():
        seed_torch(seed)
        opt = _optimizer(optimizer, _trainable(model), lr, momentum)
        if on_boundary is not None:
            on_boundary(0, run.checkpoint(opt))
        losses: list[float] = []
        total, seen = 0.0, 0
        started = time.perf_counter()
        for step in range(steps):
            index = rows(step)
            loss = run.step(opt, index, y)
            losses.append(loss)
            total, seen = total + loss * len(index), seen + len(index)
            done = step + 1
            if on_boundary is not None and (done % k == 0 or done == steps):
                on_boundary(math.ceil(done / k), run.checkpoint(opt))
            if progress is not None and (done % per_report == 0 or done == steps):
                progress(math.ceil(done / per_report), reports, total / seen)
                total, seen = 0.0, 0
        train_seconds = time.perf_counter() - started
        final_optimizer = run.optimizer_state(opt)

    return TrainResult(
        state_dict=_detached_state(model),
        samples=samples,
        steps=steps,
        loss_before=loss_before,
        loss_after=evaluate(model, X, y)["loss"],
        train_seconds=train_seconds,
        optimizer_state=final_optimizer,
        step_losses=losses,
    )


def seed_torch(seed: int) -> None:
    """torch.manual_seed, without its cost where CUDA is absent: there it still queues the seed for a CUDA
    initialisation that never comes, formatting the call stack each time (reading source lines through
    linecache): a fifth of a small segment's re-training on the site, and of a small unit's on a CPU device."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def warm_up() -> float:
    """Pay torch's first-use costs now, not inside a round: a process's first training step costs about a second
    more than the next (lazy initialisation in autograd and the optimizers), which a unit's or a re-execution's
    first round would otherwise wait on. Trains a tiny mlp a few steps; returns the seconds it took."""
    from muninn_worker import zoo  # the templates are imported when needed, not with training

    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]):  # building the model draws its initial weights: not from our stream
        generator = torch.Generator().manual_seed(0)
        model = zoo.build_model("mlp", {"in_features": 8, "num_classes": 2, "hidden": [8]})
        X, y = torch.randn(64, 8, generator=generator), torch.randint(0, 2, (64,), generator=generator)
        train_local(model, X, y, epochs=1, batch_size=16, lr=0.01, momentum=0.9, seed=0, segment_steps=2,
                    on_boundary=lambda index, checkpoint: None)
    return time.perf_counter() - started


def train_segment(
    model: nn.Module,
    X: Tensor,
    y: Tensor,
    start: Checkpoint,
    *,
    first_step: int,
    steps: int,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float = 0.0,
    seed: int,
    optimizer: str = "sgd",
    inner_steps: int | None = None,
    numerics: str = "native",
) -> tuple[Checkpoint, list[float]]:
    """Re-train steps [first_step, first_step + steps) of a unit from the checkpoint `start`, exactly as
    `train_local` trained them: the validator's half of a segment check. Returns the end state and the loss
    of each step. `epochs` only sizes the schedule (the batches of step s depend on s, not on the total)."""
    model.load_state_dict(start.weights, strict=True)
    X, y = _prepare(model, X, y)
    rows = _Rows(seed=seed, samples=X.shape[0], batch_size=batch_size, inner_steps=inner_steps)
    with _Numerics(model, X, numerics) as run, torch.random.fork_rng(devices=[]), torch.enable_grad():
        seed_torch(seed)
        opt = _optimizer(optimizer, _trainable(model), lr, momentum)
        _load_optimizer_state(opt, model, start.optimizer)
        losses = [run.step(opt, rows(step), y) for step in range(first_step, first_step + steps)]
        return run.checkpoint(opt), losses


def initial_optimizer_state(model: nn.Module, optimizer: str, momentum: float = 0.0) -> dict[str, Tensor]:
    """The optimizer state before the first step, in the checkpoint's form: what boundary 0 commits to."""
    params = dict(_named_trainable(model))
    if optimizer == "adam":
        state = {}
        for name, p in params.items():
            state[f"exp_avg:{name}"] = torch.zeros(p.shape, dtype=torch.float32)
            state[f"exp_avg_sq:{name}"] = torch.zeros(p.shape, dtype=torch.float32)
            state[f"step:{name}"] = torch.zeros((), dtype=torch.float32)
        return state
    if optimizer == "sgd":
        if momentum == 0:
            return {}
        return {f"momentum_buffer:{name}": torch.zeros(p.shape, dtype=torch.float32) for name, p in params.items()}
    raise ValueError(f"unknown optimizer {optimizer!r} (known: sgd, adam)")


class _Rows:
    """The shard rows of each step (`order.batch_indices`), as a tensor index."""

    def __init__(self, *, seed: int, samples: int, batch_size: int, inner_steps: int | None) -> None:
        self._args = {"seed": seed, "samples": samples, "batch_size": batch_size, "inner_steps": inner_steps}

    def __call__(self, step: int) -> list[int]:
        return order.batch_indices(step, **self._args)


class _Numerics:
    """Runs steps in the chosen arithmetic. "native": the model's own dtype on its own device. "f64": a
    float64 copy of everything, rounded to float32 after every step (the state stays float32-representable,
    so checkpoints are exact); the model is float32 again on exit."""

    def __init__(self, model: nn.Module, X: Tensor, numerics: str) -> None:
        if numerics not in NUMERICS:
            raise ValueError(f"unknown numerics {numerics!r} (known: {', '.join(NUMERICS)})")
        self.model, self.X, self.f64 = model, X, numerics == "f64"
        self._dtypes = {k: v.dtype for k, v in model.state_dict(keep_vars=True).items()}

    def __enter__(self) -> _Numerics:
        if self.f64:
            self.model.double()
            if self.X.is_floating_point():
                self.X = self.X.double()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.f64:
            self.model.float()

    def step(self, opt: torch.optim.Optimizer, rows: list[int], y: Tensor) -> float:
        index = torch.tensor(rows, dtype=torch.long, device=self.X.device)
        opt.zero_grad(set_to_none=True)
        target = y[index]
        if self.f64 and target.is_floating_point():
            target = target.double()
        loss = tasks.loss(self.model, self.model(self.X[index]), target)
        loss.backward()
        opt.step()
        if self.f64:
            self._round(opt)
        return float(loss.item())

    @torch.no_grad()
    def _round(self, opt: torch.optim.Optimizer) -> None:
        for p in self.model.parameters():
            p.copy_(p.float())
        for slots in opt.state.values():
            for value in slots.values():
                if torch.is_tensor(value) and value.is_floating_point():
                    value.copy_(value.float())

    def checkpoint(self, opt: torch.optim.Optimizer) -> Checkpoint:
        weights = {k: v.to(self._dtypes.get(k, v.dtype)) for k, v in _detached_state(self.model).items()}
        return Checkpoint(weights, self.optimizer_state(opt))

    def optimizer_state(self, opt: torch.optim.Optimizer) -> dict[str, Tensor]:
        state = {}
        for name, p in _named_trainable(self.model):
            for slot, value in opt.state.get(p, {}).items():
                if torch.is_tensor(value):
                    value = value.detach().to("cpu", torch.float32).clone().contiguous()
                    state[f"{slot}:{name}"] = value
        return state or _zero_state(opt, self.model)


def _zero_state(opt: torch.optim.Optimizer, model: nn.Module) -> dict[str, Tensor]:
    """Before the first step torch keeps no state: the checkpoint then holds the zeros it starts from."""
    if isinstance(opt, torch.optim.Adam):
        return initial_optimizer_state(model, "adam")
    return initial_optimizer_state(model, "sgd", opt.defaults.get("momentum", 0.0))


def _load_optimizer_state(opt: torch.optim.Optimizer, model: nn.Module, state: dict[str, Tensor]) -> None:
    """Put a checkpoint's optimizer state back into `opt` (the zeros of boundary 0 act exactly like a fresh
    optimizer: SGD's first step sets its buffer to the gradient, 0.9 x 0 + g; Adam's starts from zero moments)."""
    named = dict(_named_trainable(model))
    expected = set(initial_optimizer_state(model, "adam" if isinstance(opt, torch.optim.Adam) else "sgd",
                                           opt.defaults.get("momentum", 0.0)))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state))[:3], sorted(set(state) - expected)[:3]
        raise ValueError(f"the checkpoint's optimizer state does not fit this model (missing {missing}, "
                         f"unexpected {extra})")
    for key, value in state.items():
        slot, name = key.split(":", 1)
        p = named[name]
        if slot == "step":
            opt.state[p][slot] = value.detach().to(torch.float32).clone()
        else:
            if tuple(value.shape) != tuple(p.shape):
                raise ValueError(f"optimizer state {key!r} has shape {list(value.shape)}; expected {list(p.shape)}")
            opt.state[p][slot] = value.detach().to(p.device, p.dtype).clone()


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for _, p in _named_trainable(model)]


def _named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _optimizer(name: str, params: list, lr: float, momentum: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r} (known: sgd, adam)")


@torch.inference_mode()
def loss_on(model: nn.Module, X: Tensor, y: Tensor) -> float:
    """`evaluate(model, X, y)["loss"]`, the same value computed the same way (chunks summed, then divided), without
    the other metrics, and without walking the modules when the model is in eval mode already (a site's check
    model is kept so): a result's shard check computes two of these on a few samples, where that overhead was
    most of the cost."""
    X, y = _prepare(model, X, y)
    was_training = model.training
    if was_training:
        model.eval()
    chunk = _eval_rows(X)
    total = 0.0
    try:
        for start in range(0, X.shape[0], chunk):
            total += tasks.loss_sum(model, model(X[start : start + chunk]), y[start : start + chunk]).item()
    finally:
        if was_training:
            model.train()
    return total / tasks.sample_count(tasks.task_of(model), y)


@torch.no_grad()
def evaluate(model: nn.Module, X: Tensor, y: Tensor) -> dict[str, float]:
    """The task's metrics of `model` on the whole of (X, y): always "loss" (the training loss), plus
    "accuracy" (classification), "mse" and "rmse" (regression) or "perplexity" (language model)."""
    X, y = _prepare(model, X, y)
    was_training = model.training
    model.eval()
    chunk = _eval_rows(X)
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
        rows = _eval_rows(X)  # a language model's windows hold `context` tokens each: _EVAL_CHUNK tokens a pass
        chunks = [model(X[i : i + rows]) for i in range(0, X.shape[0], rows)]
        chunks = [c if regression else c.argmax(dim=-1) for c in chunks]
    finally:
        model.train(was_training)
    return torch.cat(chunks).cpu() if chunks else torch.empty(0, dtype=torch.long)


def _eval_rows(X: Tensor) -> int:
    """Rows per evaluation chunk: _EVAL_CHUNK samples, or _EVAL_CHUNK tokens of a language model's windows."""
    return max(1, _EVAL_CHUNK // (X.shape[1] if X.ndim == 2 and not X.is_floating_point() else 1))


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
