"""The training set-ups the verification benches calibrate on: one per template (resnet18 at two learning
rates), with realistic inputs built the way a job builds them (muninn_worker.datasets → muninn_worker.preparation → the zoo),
split and sharded like a 3-device round, and the honest units drawn from them.

A unit u of a case trains on shard u mod 3 of the training split drawn with seed u div 3, with training seed
1000 + u. Its segments are measured from one of four starts (`STARTS`, in turn): the first segment of a unit
of round 1 (the job's initial weights, a fresh optimizer), a segment 10 steps into a unit, the first segment
of a later round's unit (weights trained 20 steps, a fresh optimizer) and a segment 40 steps into a unit.
Half the starts are a unit's first segment because every unit has one, and a fresh optimizer is where the
arithmetic matters most (Adam's first steps on LoRA's zero-initialised adapters; resnet18's first step).
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from muninn_worker import order, training, zoo
from muninn_worker.samples import generated_text
from muninn_worker.segments import Checkpoint
from sklearn.datasets import load_digits
from torch import Tensor

from muninn_worker import datasets, preparation
from muninn_worker.federated.sharding import plan_shards

ROUND_DEVICES = 3  # the default unit is one shard of a 3-device round
# (what the start is, steps trained before it, whether the optimizer starts afresh there)
STARTS = (("round 1, step 0", 0, True), ("10 steps in", 10, False), ("later round, step 0", 20, True),
          ("40 steps in", 40, False))


@dataclass
class Case:
    """A template set up on its data: everything a unit needs but the shard."""

    name: str  # the row's name ("resnet18_lr0.01")
    template: str
    config: dict
    hp: dict
    X: Tensor  # the whole dataset's samples; units take shards of a training split of it
    y: Tensor
    state: dict[str, Tensor]  # the job's initial global weights
    base: dict[str, Tensor] | None  # LoRA's frozen base weights
    data: str  # what the data is, in words

    @property
    def optimizer(self) -> str:
        return zoo.get_template(self.template).optimizer

    def model(self) -> torch.nn.Module:
        model = zoo.build_model(self.template, self.config)
        model.load_state_dict(self.state)
        if self.base is not None:
            zoo.load_base(model, self.base)
        return model

    def train_args(self) -> dict:
        return {"epochs": self.hp["epochs"], "batch_size": self.hp["batch_size"], "lr": self.hp["lr"],
                "momentum": self.hp.get("momentum", 0.0), "optimizer": self.optimizer}

    def shard(self, unit: int) -> tuple[Tensor, Tensor]:
        train, _ = datasets.split_holdout(len(self.y), seed=unit // ROUND_DEVICES)
        shard = plan_shards(len(train), [1.0] * ROUND_DEVICES)[unit % ROUND_DEVICES]
        rows = torch.from_numpy(train[shard.start:shard.stop])
        return self.X[rows], self.y[rows]

    def default_unit_steps(self) -> int:
        """Optimizer steps of one unit of a default job on this data: a shard of a 3-device round, trained for
        the template's default epochs (the case's hparams are the defaults but for size knobs)."""
        X, _ = self.shard(0)
        return order.total_steps(len(X), epochs=self.hp["epochs"], batch_size=self.hp["batch_size"])


@dataclass
class Unit:
    case: Case
    number: int
    X: Tensor
    y: Tensor
    seed: int
    first_step: int  # the step of the unit the measured segments start at
    start: Checkpoint  # the state there

    def train(self, start: Checkpoint, *, first_step: int, steps: int, numerics: str = "native",
              X: Tensor | None = None, y: Tensor | None = None, lr: float | None = None,
              keep: set[int] | None = None) -> dict[int, Checkpoint]:
        """Re-train `steps` steps from `start` with train_segment, one step at a time (bitwise the same as in
        one go), and return the states after the step counts in `keep` (default: only the end)."""
        args = self.case.train_args()
        if lr is not None:
            args["lr"] = lr
        X = self.X if X is None else X
        y = self.y if y is None else y
        keep = {steps} if keep is None else keep
        model, kept, at = self._model(), {}, start
        for done in range(1, steps + 1):
            at, _ = training.train_segment(model, X, y, at, first_step=first_step + done - 1, steps=1,
                                           seed=self.seed, numerics=numerics, **args)
            if done in keep:
                kept[done] = at
        return kept

    def _model(self) -> torch.nn.Module:
        if getattr(self, "_cached", None) is None:  # train_segment loads each start's weights into it
            self._cached = self.case.model()
        return self._cached


def make_unit(case: Case, number: int) -> Unit:
    X, y = case.shard(number)
    seed = 1000 + number
    _, warmup, fresh = STARTS[number % len(STARTS)]
    model = case.model()
    fresh_optimizer = training.initial_optimizer_state(model, case.optimizer, case.hp.get("momentum", 0.0))
    start = Checkpoint(dict(case.state), fresh_optimizer)
    unit = Unit(case, number, X, y, seed, warmup, start)
    if warmup:
        unit.start = unit.train(start, first_step=0, steps=warmup)[warmup]
    if fresh:  # a new unit from these weights: its steps count from 0 again
        unit.start, unit.first_step = Checkpoint(unit.start.weights, fresh_optimizer), 0
    return unit


def start_of(number: int) -> str:
    return STARTS[number % len(STARTS)][0]


def _npz(X: np.ndarray, y: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, X=X, y=y)
    return buffer.getvalue()


def _prepared(template: str, data: bytes, fmt: str, hparams: dict, *, profile_extra: dict | None = None,
              options: dict | None = None):
    parsed = datasets.parse_dataset(data, fmt, **(options or {}))
    hp = zoo.validate_hparams(template, hparams)
    profile = {**parsed.profile, **(profile_extra or {})}
    config = zoo.model_config_for(template, profile, hp)
    if fmt == "npz":
        parsed = datasets.parse_dataset(data, fmt, **preparation.parse_options(parsed.profile, config))
    X, y = preparation.samples(parsed, config)
    return hp, config, X, y


def _initial(template: str, config: dict, X: Tensor, y: Tensor, seed: int = 11) -> dict[str, Tensor]:
    train, _ = datasets.split_holdout(len(y), seed=0)
    return zoo.get_template(template).fit_state(zoo.init_state(template, config, seed), X[train], y[train])


def mlp() -> Case:
    digits = load_digits()
    hp, config, X, y = _prepared("mlp", _npz(digits.data.astype(np.float32), digits.target), "npz", {})
    return Case("mlp", "mlp", config, hp, X, y, _initial("mlp", config, X, y), None,
                "scikit-learn digits (1797 rows, 64 features), default hparams")


def cnn() -> Case:
    digits = load_digits()
    hp, config, X, y = _prepared("cnn", _npz(digits.images.astype(np.float32), digits.target), "npz", {})
    return Case("cnn", "cnn", config, hp, X, y, _initial("cnn", config, X, y), None,
                "scikit-learn digits as 8x8 images (1797), default hparams")


def _digits_32() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits scaled up to 32x32 (bilinear): real handwriting at resnet18's size. (The generated
    shapes of muninn_worker.samples are learnt so fast that the loss, and with it every gradient, is exactly 0
    within a few dozen steps: segments of a model that no longer learns say nothing about cheats.)"""
    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32))[:, None]
    scaled = torch.nn.functional.interpolate(images, size=(32, 32), mode="bilinear", align_corners=False)
    return scaled.numpy(), digits.target


def resnet18(lr: float, base_width: int) -> Case:
    images, labels = _digits_32()
    hp, config, X, y = _prepared("resnet18", _npz(images, labels), "npz", {"base_width": base_width, "lr": lr})
    return Case(f"resnet18_lr{lr:g}", "resnet18", config, hp, X, y, _initial("resnet18", config, X, y), None,
                f"scikit-learn digits scaled to 32x32 (1797), base_width {base_width}, lr {lr:g}, batch 64")


def transformer() -> Case:
    text = generated_text(seed=0, sentences=1500).encode()
    hp, config, X, y = _prepared("transformer", text, "text", {}, options={"tokenizer": "byte"})
    return Case("transformer", "transformer", config, hp, X, y, _initial("transformer", config, X, y), None,
                f"generated text ({len(text)} bytes, byte tokens, {len(y)} windows of 64), default hparams")


def lora(base_steps: int = 60) -> Case:
    """LoRA on a second text, over a transformer first trained `base_steps` steps on the first (the base a
    customer uploads)."""
    base_case = transformer()
    model = base_case.model()
    X, y = base_case.X, base_case.y
    training.train_local(model, X, y, epochs=1, batch_size=32, lr=3e-3, seed=1, optimizer="adam",
                         inner_steps=base_steps)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    text = generated_text(seed=1, sentences=1500, style="b").encode()
    hp, config, X, y = _prepared("lora", text, "text", {}, options={"tokenizer": "byte"},
                                 profile_extra={"base_model_config": zoo.lm_config_from_base(base, heads=4)})
    state = zoo.init_state("lora", config, 11)
    return Case("lora", "lora", config, hp, X, y, state, base,
                f"generated text b ({len(text)} bytes) over a transformer trained {base_steps} steps on text a, "
                "rank 8, default hparams")


def cases(*, quick: bool = False, resnet_width: int | None = None) -> list[Case]:
    width = resnet_width or (8 if quick else 16)
    return [mlp(), cnn(), resnet18(0.01, width), resnet18(0.05, width), transformer(), lora()]


def per_epoch(case: Case, unit: Unit) -> int:
    return math.ceil(len(unit.y) / case.hp["batch_size"])
