"""Local training: deterministic for a seed, and it actually learns."""

from __future__ import annotations

import torch
from conftest import MODEL_CONFIG, digits, global_weights

from muninn_worker.training import evaluate, predict, train_local
from muninn_worker.zoo import build_model

TRAIN = {"epochs": 2, "batch_size": 32, "lr": 0.05, "momentum": 0.9}


def _model(X: torch.Tensor) -> torch.nn.Module:
    model = build_model("mlp", MODEL_CONFIG)
    model.load_state_dict(global_weights(X))
    return model


def test_same_seed_gives_bitwise_identical_weights():
    X, y = digits(300)

    first = train_local(_model(X), X, y, seed=7, **TRAIN)
    second = train_local(_model(X), X, y, seed=7, **TRAIN)

    assert first.state_dict.keys() == second.state_dict.keys()
    for key in first.state_dict:
        assert torch.equal(first.state_dict[key], second.state_dict[key]), key
    assert first.loss_after == second.loss_after


def test_different_seed_gives_different_weights():
    X, y = digits(300)

    first = train_local(_model(X), X, y, seed=7, **TRAIN)
    second = train_local(_model(X), X, y, seed=8, **TRAIN)

    assert not torch.equal(first.state_dict["layers.0.weight"], second.state_dict["layers.0.weight"])


def test_training_lowers_the_loss_on_digits():
    X, y = digits(1000)
    model = _model(X)
    seen: list[tuple[int, int, float]] = []

    result = train_local(model, X, y, seed=1, progress=lambda e, n, loss: seen.append((e, n, loss)), **TRAIN)

    assert result.loss_after < 0.5 * result.loss_before
    assert evaluate(model, X, y)["accuracy"] > 0.9
    assert [(e, n) for e, n, _ in seen] == [(1, 2), (2, 2)]
    assert result.samples == 1000 and result.steps == 2 * 32  # ceil(1000 / 32) = 32 steps per epoch
    assert result.train_seconds > 0


def test_result_is_detached_cpu_tensors_that_do_not_alias_the_model():
    X, y = digits(100)
    model = _model(X)

    result = train_local(model, X, y, seed=1, **TRAIN)
    with torch.no_grad():
        model.layers[0].weight.add_(1.0)

    assert all(t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad
               for t in result.state_dict.values())
    assert not torch.equal(result.state_dict["layers.0.weight"], model.layers[0].weight)


def test_normalisation_buffers_are_not_trained():
    X, y = digits(200)
    model = _model(X)
    mean_before = model.norm_mean.clone()

    result = train_local(model, X, y, seed=1, **TRAIN)

    assert torch.equal(result.state_dict["norm_mean"], mean_before)


def test_evaluate_and_predict_agree():
    X, y = digits(200)
    model = _model(X)

    accuracy = evaluate(model, X, y)["accuracy"]
    predicted = predict(model, X)

    assert predicted.dtype == torch.int64 and predicted.shape == (200,)
    assert accuracy == (predicted == y).sum().item() / 200


def test_training_works_when_called_inside_no_grad():
    X, y = digits(100)

    with torch.no_grad():
        result = train_local(_model(X), X, y, seed=1, **TRAIN)

    assert result.loss_after < result.loss_before


def test_inner_steps_train_exactly_that_many_full_batches_whatever_the_shard_size():
    X, y = digits(50)
    model = build_model("mlp", MODEL_CONFIG)
    model.load_state_dict(global_weights(X))
    reports = []

    result = train_local(model, X, y, epochs=3, batch_size=32, lr=0.05, momentum=0.9, seed=1, inner_steps=5,
                         progress=lambda epoch, epochs, loss: reports.append((epoch, epochs)))

    assert result.steps == 5  # not 3 epochs × ceil(50 / 32)
    assert reports == [(1, 3), (2, 3), (3, 3)]  # every ceil(50/32) = 2 steps, and at the end
    assert result.loss_after < result.loss_before


def test_inner_steps_are_deterministic_for_a_seed():
    X, y = digits(40)
    runs = []
    for _ in range(2):
        model = build_model("mlp", MODEL_CONFIG)
        model.load_state_dict(global_weights(X))
        runs.append(train_local(model, X, y, epochs=1, batch_size=16, lr=0.05, seed=3, inner_steps=4).state_dict)
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_seed_torch_draws_as_torch_manual_seed_does_and_queues_nothing_for_an_absent_cuda():
    from torch.cuda import _lazy_seed_tracker

    from muninn_worker.training import seed_torch

    torch.manual_seed(7)
    expected = torch.rand(5), torch.nn.functional.dropout(torch.ones(8), 0.5)
    queued = _lazy_seed_tracker.manual_seed_all_cb

    seed_torch(7)

    assert torch.equal(torch.rand(5), expected[0])
    assert torch.equal(torch.nn.functional.dropout(torch.ones(8), 0.5), expected[1])
    if not torch.cuda.is_available():  # torch.manual_seed queued a seed (and its stack) for CUDA; this does not
        assert queued is not None and _lazy_seed_tracker.manual_seed_all_cb is queued
