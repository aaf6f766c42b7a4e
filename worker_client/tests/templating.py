"""Helpers for the template tests: data as the site prepares it, and training through train_local."""

from __future__ import annotations

import numpy as np
import torch

from muninn_worker import training, zoo


def split(n: int, seed: int = 0, test_fraction: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    n_test = round(n * test_fraction)
    return order[n_test:], order[:n_test]


def fresh_model(template: str, config: dict, X: torch.Tensor, y: torch.Tensor, seed: int = 0) -> torch.nn.Module:
    """The job's initial model: seeded weights, data-derived buffers filled from the training split."""
    spec = zoo.get_template(template)
    state = spec.fit_state(zoo.init_state(template, config, seed), X, y)
    model = zoo.build_model(template, config)
    model.load_state_dict(state)
    if spec.needs_base:  # a LoRA model's frozen base: here a seeded transformer stands in for the upload
        base_config = {k: v for k, v in config.items() if k not in ("rank", "alpha")}
        zoo.load_base(model, zoo.init_state("transformer", base_config, seed + 1))
    return model


def train(template: str, model: torch.nn.Module, X, y, *, seed: int = 1, **overrides) -> training.TrainResult:
    spec = zoo.get_template(template)
    hp = zoo.validate_hparams(template, overrides)
    return training.train_local(model, X, y, epochs=hp["epochs"], batch_size=hp["batch_size"], lr=hp["lr"],
                                momentum=hp.get("momentum", 0.0), seed=seed, optimizer=spec.optimizer)


def char_windows(text: str, vocab: list[str], context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows of context + 1 characters: X the first context, y the next character of each."""
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
    n = (len(ids) - 1) // context
    X = ids[: n * context].view(n, context)
    y = ids[1 : n * context + 1].view(n, context)
    return X, y
