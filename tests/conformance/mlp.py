"""Training an `mlp` unit as docs/worker-protocol.md describes it ("The mlp template", "The data order",
"Determinism", "Segments, commitments and challenges"): the model as plain tensor arithmetic, SplitMix64 and
Fisher–Yates for the batches, SGD written out by hand, and the state at every segment boundary.

Written from the document alone: nothing here comes from the reference client (muninn_worker)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def permutation(seed: int, epoch: int, n: int) -> list[int]:
    state = (seed * GOLDEN + epoch + 1) & MASK

    def next_value() -> int:
        nonlocal state
        state = (state + GOLDEN) & MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        j = next_value() % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


class Order:
    """The rows of optimizer step s: FedAvg's batches of each epoch's permutation, or DiLoCo's min(b, n) rows
    read on through back-to-back permutations."""

    def __init__(self, seed: int, n: int, batch_size: int, inner_steps: int | None):
        self.seed, self.n, self.b, self.inner = seed, n, batch_size, inner_steps
        self._perms: dict[int, list[int]] = {}

    def perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            self._perms[epoch] = permutation(self.seed, epoch, self.n)
        return self._perms[epoch]

    def rows(self, step: int) -> list[int]:
        if self.inner is None:
            per_epoch = math.ceil(self.n / self.b)
            epoch, p = divmod(step, per_epoch)
            return self.perm(epoch)[p * self.b:(p + 1) * self.b]
        width = min(self.b, self.n)
        return [self.perm(at // self.n)[at % self.n] for at in range(step * width, (step + 1) * width)]


class MLP:
    """(x − norm_mean) / norm_std, then Linear/ReLU layers `layers.<2i>`, then the Linear head; a regression head
    answers `out * target_std + target_mean`. Parameters are the Linear weights and biases; the rest are buffers."""

    def __init__(self, model_config: dict, state: dict[str, torch.Tensor]):
        self.regression = model_config.get("task", "classification") == "regression"
        widths = [model_config["in_features"], *model_config["hidden"],
                  1 if self.regression else model_config["num_classes"]]
        self.linear = [f"layers.{2 * i}" for i in range(len(widths) - 1)]
        expected = {"norm_mean", "norm_std", *(f"{n}.{p}" for n in self.linear for p in ("weight", "bias"))}
        if self.regression:
            expected |= {"target_mean", "target_std"}
        if set(state) != expected:
            raise ValueError(f"the weights' tensors {sorted(state)} are not the mlp's {sorted(expected)}")
        for i, name in enumerate(self.linear):
            assert tuple(state[f"{name}.weight"].shape) == (widths[i + 1], widths[i]), name
        self.state = {k: v.clone() for k, v in state.items()}
        self.params = [f"{n}.{p}" for n in self.linear for p in ("weight", "bias")]

    def forward(self, x: torch.Tensor, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        s = {**self.state, **(params or {})}
        h = (x.flatten(1) - s["norm_mean"]) / s["norm_std"]
        for i, name in enumerate(self.linear):
            h = F.linear(h, s[f"{name}.weight"], s[f"{name}.bias"])
            if i < len(self.linear) - 1:
                h = F.relu(h)
        return h.squeeze(-1) * s["target_std"] + s["target_mean"] if self.regression else h

    def loss_sum(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.regression:
            std = self.state["target_std"]
            return F.mse_loss(out / std, y / std, reduction="sum")
        return F.cross_entropy(out, y, reduction="sum")

    @torch.no_grad()
    def mean_loss(self, X: torch.Tensor, y: torch.Tensor) -> float:
        return float(self.loss_sum(self.forward(X), y)) / X.shape[0]


@dataclass
class Trained:
    state: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    steps: int
    loss_before: float
    loss_after: float
    train_seconds: float
    boundaries: list[tuple[dict, dict]] = field(default_factory=list)  # (weights, optimizer state) per boundary


def train(model: MLP, X: torch.Tensor, y: torch.Tensor, train_spec: dict) -> Trained:
    """SGD (buffer ← momentum · buffer + gradient; parameter ← parameter − lr · buffer) on the mean loss of each
    batch, with a checkpoint at every boundary of segment_steps steps."""
    if train_spec.get("optimizer", "sgd") != "sgd":
        raise NotImplementedError("this client trains SGD units only (the mlp template)")
    n, b, k = X.shape[0], train_spec["batch_size"], train_spec["segment_steps"]
    inner = train_spec.get("inner_steps")
    steps = inner if inner is not None else train_spec["epochs"] * math.ceil(n / b)
    lr, momentum = train_spec["lr"], train_spec.get("momentum", 0.0)
    order = Order(train_spec["seed"], n, b, inner)
    y = y.to(torch.float32 if model.regression else torch.int64)
    loss_before = model.mean_loss(X, y)
    params = {name: model.state[name].clone().requires_grad_(True) for name in model.params}
    buffers = {name: torch.zeros_like(p) for name, p in params.items()} if momentum else {}

    def snapshot() -> tuple[dict, dict]:
        weights = {**model.state, **{k_: v.detach().clone() for k_, v in params.items()}}
        return weights, {f"momentum_buffer:{k_}": v.clone() for k_, v in buffers.items()}

    boundaries = [snapshot()]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(train_spec["seed"])
        started = time.monotonic()
        for step in range(steps):
            index = torch.tensor(order.rows(step), dtype=torch.long)
            loss = model.loss_sum(model.forward(X[index], params), y[index]) / len(index)
            grads = torch.autograd.grad(loss, list(params.values()))
            with torch.no_grad():
                for (name, p), g in zip(params.items(), grads):
                    if momentum:
                        buffers[name].mul_(momentum).add_(g)
                        p.sub_(lr * buffers[name])
                    else:
                        p.sub_(lr * g)
            if (step + 1) % k == 0 or step + 1 == steps:
                boundaries.append(snapshot())
        train_seconds = time.monotonic() - started
    model.state.update({k_: v.detach().clone() for k_, v in params.items()})
    return Trained(state=dict(model.state), optimizer=boundaries[-1][1], steps=steps, loss_before=loss_before,
                   loss_after=model.mean_loss(X, y), train_seconds=train_seconds, boundaries=boundaries)
