"""Every template beats its stated baseline on real data that ships (scikit-learn's bundled sets) or on data
the code generates. Trained in-process through train_local, the very loop the worker client runs."""

from __future__ import annotations

import math

import torch
from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits, load_wine
from templating import char_windows, fresh_model, split, train

from muninn_worker import training, zoo
from muninn_worker.samples import generated_text


def _table(loader, regression: bool = False):
    data = loader()
    X = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.float32 if regression else torch.int64)
    train_idx, test_idx = split(len(y))
    return X[train_idx], y[train_idx], X[test_idx], y[test_idx]


def test_cnn_reaches_95_percent_on_digits():
    digits = load_digits()
    X = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)  # [n, 1, 8, 8]
    y = torch.tensor(digits.target)
    train_idx, test_idx = split(len(y))
    config = {"channels": 1, "height": 8, "width": 8, "num_classes": 10, "filters": [16, 32]}
    model = fresh_model("cnn", config, X[train_idx], y[train_idx])

    train("cnn", model, X[train_idx], y[train_idx], epochs=8)

    assert training.evaluate(model, X[test_idx], y[test_idx])["accuracy"] >= 0.95


def test_mlp_reaches_93_percent_on_breast_cancer_and_wine():
    for loader in (load_breast_cancer, load_wine):
        X_train, y_train, X_test, y_test = _table(loader)
        config = {"in_features": X_train.shape[1], "num_classes": int(y_train.max()) + 1, "hidden": [32]}
        model = fresh_model("mlp", config, X_train, y_train)

        train("mlp", model, X_train, y_train, epochs=20, batch_size=16, lr=0.01)

        assert training.evaluate(model, X_test, y_test)["accuracy"] >= 0.93, loader.__name__


def test_mlp_regression_beats_the_mean_on_diabetes_by_30_percent():
    # Diabetes is noisy: even the least-squares fit removes only ~30% of the mean's RMSE (0.61-0.78 of it on
    # single 80/20 splits), so one split would decide this test by luck. It is judged on five fixed splits.
    data = load_diabetes()
    X, y = torch.tensor(data.data, dtype=torch.float32), torch.tensor(data.target, dtype=torch.float32)
    ratios = []
    for seed in range(5):
        train_idx, test_idx = split(len(y), seed)
        config = {"in_features": X.shape[1], "hidden": [32], "task": "regression"}
        model = fresh_model("mlp", config, X[train_idx], y[train_idx])
        baseline = math.sqrt(((y[test_idx] - y[train_idx].mean()) ** 2).mean().item())  # predict the mean

        train("mlp", model, X[train_idx], y[train_idx], epochs=10, batch_size=32, lr=0.005)
        ratios.append(training.evaluate(model, X[test_idx], y[test_idx])["rmse"] / baseline)

    assert sum(ratios) / len(ratios) <= 0.7, ratios
    assert training.predict(model, X[:3]).dtype == torch.float32  # answers in the target's own units


def test_transformer_perplexity_is_below_half_the_uniform_on_generated_text():
    text = generated_text(seed=0, sentences=1500)
    vocab = sorted(set(text))
    X, y = char_windows(text, vocab, context=32)
    train_idx, test_idx = split(len(y))
    config = {"vocab_size": len(vocab), "context": 32, "d_model": 64, "layers": 2, "heads": 4}
    model = fresh_model("transformer", config, X[train_idx], y[train_idx])

    train("transformer", model, X[train_idx], y[train_idx], epochs=3)
    perplexity = training.evaluate(model, X[test_idx], y[test_idx])["perplexity"]

    assert perplexity < len(vocab) / 2, (perplexity, len(vocab))


def test_lora_moves_the_loss_on_a_new_text_with_the_base_frozen_and_small_uploads():
    vocab = sorted(set(generated_text(sentences=300) + generated_text(sentences=300, style="b")))
    base_config = {"vocab_size": len(vocab), "context": 32, "d_model": 64, "layers": 2, "heads": 4}
    X_a, y_a = char_windows(generated_text(seed=0, sentences=600), vocab, 32)
    base = fresh_model("transformer", base_config, X_a, y_a)
    train("transformer", base, X_a, y_a, epochs=2)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    X_b, y_b = char_windows(generated_text(seed=1, sentences=600, style="b"), vocab, 32)
    config = {**base_config, "rank": 4, "alpha": 8.0}
    lora = zoo.build_model("lora", config)
    lora.load_state_dict(zoo.init_state("lora", config, seed=0))
    zoo.load_base(lora, base_state)

    result = train("lora", lora, X_b, y_b, epochs=2)

    assert result.loss_after < 0.8 * result.loss_before  # the adapters learnt the new text
    assert set(result.state_dict) == {k for k in result.state_dict if k.endswith((".lora_a", ".lora_b"))}
    for name, tensor in base_state.items():  # the base stayed frozen
        assert torch.equal(lora.get_buffer(name), tensor), name
    adapters = sum(t.numel() for t in result.state_dict.values())
    full = sum(t.numel() for t in base_state.values())
    assert adapters < 0.1 * full  # what a device uploads per round
    merged = zoo.build_model("transformer", base_config)
    merged.load_state_dict(zoo.merge_lora(config, base_state, result.state_dict))
    assert torch.allclose(merged(X_b[:4]), lora(X_b[:4]), atol=1e-4)  # the merged model is the fine-tuned one
