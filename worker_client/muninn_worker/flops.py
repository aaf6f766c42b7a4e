"""How much work a unit is: FLOPs counted by torch, and a peak-memory estimate.

The site prices jobs and credits contributors from these numbers (1 HU = 1e16 FLOPs), so they are
counted, not guessed: `FlopCounterMode` records the matmuls of one real forward + backward pass.
Element-wise ops (ReLU, the normalisation, the optimizer step) are not counted; they are small next to the
matmuls and counting them the same way on both sides is what matters.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from muninn_worker import tasks
from muninn_worker.zoo import build_model, get_template

__all__ = ["flops_per_sample", "forward_flops_per_sample", "unit_flops", "train_samples", "peak_memory_bytes"]


def flops_per_sample(template: str, model_config: dict, batch_size: int) -> int:
    """Training FLOPs for one sample: one forward + backward of a `batch_size` batch, divided, rounded up."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1 (got {batch_size})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(template, model_config)
    inputs, targets = get_template(template).example_batch(model_config, batch_size)
    counter = FlopCounterMode(display=False)
    with counter, torch.enable_grad():  # the caller may be inside no_grad; backward must still run
        loss = tasks.loss(model, model(inputs), targets)
        loss.backward()
    return math.ceil(counter.get_total_flops() / batch_size)


def warm_up() -> None:
    """Count a tiny model's FLOPs once: torch's FLOP counter imports torch._dynamo on its first use (~1.1 s and
    ~70 MiB measured), which a process answering requests pays at its start, not inside a customer's first quote
    while it holds the GIL from every other request of the process."""
    flops_per_sample("mlp", {"in_features": 4, "hidden": [4], "num_classes": 2}, 2)


def forward_flops_per_sample(template: str, model_config: dict, batch_size: int) -> int:
    """FLOPs of one forward pass per sample (no backward): what evaluating the shard costs."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1 (got {batch_size})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(template, model_config)
    inputs, _ = get_template(template).example_batch(model_config, batch_size)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(inputs)
    return math.ceil(counter.get_total_flops() / batch_size)


# The receipt reports the shard's loss before and after training: two forward passes over the shard.
RECEIPT_PASSES = 2


def unit_flops(flops_per_sample: int, samples: int, epochs: int, forward_flops_per_sample: int = 0, *,
               inner_steps: int | None = None, batch_size: int | None = None) -> int:
    """FLOPs of a work unit: every sample of the shard, once per local epoch, plus (when given the forward
    FLOPs per sample) the receipt's two evaluation passes over the shard, which the device also computes.

    DiLoCo units train `inner_steps` steps of min(batch_size, samples) samples each instead of epochs (see
    `training.train_local`)."""
    if min(flops_per_sample, samples, epochs, forward_flops_per_sample) < 0:
        raise ValueError("flops_per_sample, samples, epochs and forward_flops_per_sample must not be negative")
    return (int(flops_per_sample) * train_samples(samples, epochs, inner_steps=inner_steps, batch_size=batch_size)
            + int(samples) * RECEIPT_PASSES * int(forward_flops_per_sample))


def train_samples(samples: int, epochs: int, *, inner_steps: int | None = None, batch_size: int | None = None) -> int:
    """Samples a unit's training passes over: samples × epochs, or (DiLoCo) inner_steps × its batch."""
    if inner_steps is None:
        return int(samples) * int(epochs)
    if batch_size is None or batch_size < 1 or inner_steps < 1:
        raise ValueError("inner_steps needs a positive batch_size and at least one step")
    return int(inner_steps) * min(int(batch_size), int(samples))


def peak_memory_bytes(template: str, model_config: dict, batch_size: int) -> int:
    """Estimated peak training memory in bytes (an estimate for routing units to devices, not a measurement).

        peak = e * (3 * P + B) + e * 2 * batch_size * A

    with e the bytes per element (4 for float32), P the number of trainable parameters (held three times:
    weights, gradients, SGD momentum buffer), B the number of buffer and frozen elements (the normalisation,
    a LoRA model's frozen base weights), and A the activation elements per sample: the floating-point output
    of every tensor operation of one forward pass that is not a view of another tensor (so a normalised
    input, each layer's output, and a transformer's attention scores and probabilities all count).
    Activations are counted twice because backward holds a gradient of the same size next to each saved
    activation. The model is built on the meta device, so this allocates nothing.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1 (got {batch_size})")
    with torch.device("meta"):
        model = build_model(template, model_config)
    inputs, _ = get_template(template).example_batch(model_config, 1)
    element = next(model.parameters()).element_size()
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    buffers = sum(b.numel() for b in model.buffers()) + frozen
    activations = _activation_elements(model, inputs.to("meta"))
    return element * (3 * params + buffers) + element * 2 * batch_size * activations


class _ActivationCounter(TorchDispatchMode):
    """Adds up the elements of every floating-point tensor an operation creates (views and aliases excluded)."""

    # _unsafe_view shares its input's storage although its schema does not say so.
    _SHARING = {"_unsafe_view"}

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        if func._opname in self._SHARING or any(r.alias_info is not None for r in schema.returns):
            return out
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                self.total += tensor.numel()
        return out


def _activation_elements(model: nn.Module, inputs: torch.Tensor) -> int:
    counter = _ActivationCounter()
    with torch.no_grad(), counter:
        model(inputs)
    return counter.total
