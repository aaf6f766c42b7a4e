"""The template registry: hyper-parameters with bounds, configs from data profiles, deterministic training on
tiny data for every template, FLOPs and memory for the quote, the generalised shard format."""

from __future__ import annotations

import pytest
import torch
from templating import fresh_model, train
from torch.utils.flop_counter import FlopCounterMode

from muninn_worker import flops, training, zoo
from muninn_worker.tensors import BadShard, bytes_to_shard, shard_to_bytes, state_dict_to_bytes

TINY = {
    "mlp": {"in_features": 6, "num_classes": 3, "hidden": [8]},
    "cnn": {"channels": 1, "height": 8, "width": 8, "num_classes": 3, "filters": [4, 8]},
    "resnet18": {"channels": 3, "height": 8, "width": 8, "num_classes": 3, "base_width": 8},
    "transformer": {"vocab_size": 11, "context": 8, "d_model": 16, "layers": 1, "heads": 2},
    "lora": {"vocab_size": 11, "context": 8, "d_model": 16, "layers": 1, "heads": 2, "rank": 2, "alpha": 4.0},
}
METRIC = {"mlp": "accuracy", "cnn": "accuracy", "resnet18": "accuracy", "transformer": "perplexity",
          "lora": "perplexity"}


def test_registry_lists_every_template_with_its_task_metric_and_bounded_defaults():
    listed = {name: spec.describe() for name, spec in zoo.TEMPLATES.items()}

    assert set(listed) == {"mlp", "cnn", "resnet18", "transformer", "lora"}
    assert listed["mlp"]["tasks"] == ["classification", "regression"]
    assert listed["mlp"]["metrics"] == {"classification": "accuracy", "regression": "rmse"}
    assert listed["transformer"]["metrics"] == {"language_model": "perplexity"}
    assert listed["resnet18"]["tier"] == "gpu" and listed["cnn"]["tier"] == "any"
    assert listed["lora"]["needs_base_weights"] is True
    for entry in listed.values():
        for hp in entry["hparams"]:
            default = min(hp["default"]) if hp["kind"] == "int_list" else hp["default"]
            assert hp["minimum"] <= default <= hp["maximum"], (entry["name"], hp["name"])


@pytest.mark.parametrize("template, hparams, field", [
    ("cnn", {"filters": [8] * 5}, "filters"),
    ("cnn", {"image_size": 1000}, "image_size"),
    ("resnet18", {"base_width": 4}, "base_width"),
    ("transformer", {"context": 4096}, "context"),
    ("transformer", {"lr": 2.0}, "lr"),
    ("lora", {"rank": 0}, "rank"),
    ("lora", {"momentum": 0.9}, "momentum"),  # Adam templates have no momentum
])
def test_out_of_bounds_hparams_name_their_field(template, hparams, field):
    with pytest.raises(zoo.InvalidHParams) as error:
        zoo.validate_hparams(template, hparams)

    assert error.value.field == field and field in str(error.value)


def test_model_config_comes_from_the_data_profile():
    table = {"kind": "table", "features": 13, "num_classes": 3, "task": "classification"}
    numeric = {"kind": "table", "features": 10, "task": "regression"}
    images = {"kind": "image", "features": 64, "num_classes": 10, "image_shape": [1, 8, 8], "task": "classification"}
    zipped = {**images, "image_shape": [3, 32, 32], "resizable": True}
    text = {"kind": "text", "vocab_size": 40}

    assert zoo.model_config_for("mlp", table, zoo.validate_hparams("mlp", {})) == {
        "in_features": 13, "num_classes": 3, "hidden": [128]}
    assert zoo.model_config_for("mlp", numeric, zoo.validate_hparams("mlp", {}))["task"] == "regression"
    assert zoo.model_config_for("cnn", images, zoo.validate_hparams("cnn", {})) == {
        "channels": 1, "height": 8, "width": 8, "num_classes": 10, "filters": [16, 32]}
    assert zoo.model_config_for("cnn", zipped, zoo.validate_hparams("cnn", {"image_size": 24}))["height"] == 24
    assert zoo.model_config_for("transformer", text, zoo.validate_hparams("transformer", {}))["vocab_size"] == 40
    with pytest.raises(zoo.IncompatibleData, match="images"):
        zoo.model_config_for("cnn", table, zoo.validate_hparams("cnn", {}))
    with pytest.raises(zoo.IncompatibleData, match="base weights"):
        zoo.model_config_for("lora", text, zoo.validate_hparams("lora", {}))
    with pytest.raises(zoo.InvalidHParams) as error:
        zoo.model_config_for("transformer", text, zoo.validate_hparams("transformer", {"d_model": 30}))
    assert error.value.field == "heads"


def _tiny_data(template: str):
    spec = zoo.get_template(template)
    return spec.example_batch(TINY[template], 24, seed=3)


@pytest.mark.parametrize("template", sorted(TINY))
def test_every_template_trains_deterministically_for_a_seed_and_reports_its_metric(template):
    X, y = _tiny_data(template)

    first_model = fresh_model(template, TINY[template], X, y)
    first = train(template, first_model, X, y, seed=5, batch_size=8)
    second = train(template, fresh_model(template, TINY[template], X, y), X, y, seed=5, batch_size=8)
    other = train(template, fresh_model(template, TINY[template], X, y), X, y, seed=6, batch_size=8)

    assert all(torch.equal(first.state_dict[k], second.state_dict[k]) for k in first.state_dict)
    assert any(not torch.equal(first.state_dict[k], other.state_dict[k]) for k in first.state_dict)
    assert first.steps == 3 * zoo.validate_hparams(template, {})["epochs"]
    assert METRIC[template] in training.evaluate(first_model, X, y)


@pytest.mark.parametrize("template", sorted(TINY))
def test_every_template_has_a_positive_flop_count_and_memory_estimate(template):
    per_sample = flops.flops_per_sample(template, TINY[template], 4)
    memory = flops.peak_memory_bytes(template, TINY[template], 4)

    assert per_sample > 0 and memory > 0
    assert flops.peak_memory_bytes(template, TINY[template], 8) > memory


def test_resnet18_has_the_resnet18_layout_and_flops():
    config = {"channels": 3, "height": 32, "width": 32, "num_classes": 10, "base_width": 64}
    with torch.device("meta"):
        model = zoo.build_model("resnet18", config)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    params = sum(p.numel() for p in model.parameters())

    assert len(convs) == 1 + 16 + 3  # stem, 8 basic blocks of two, three projection shortcuts
    assert [len(stage) for stage in model.stages] == [2, 2, 2, 2]
    assert [stage[0].conv1.out_channels for stage in model.stages] == [64, 128, 256, 512]
    assert 11_150_000 < params < 11_200_000  # ResNet-18's 11.2 M parameters (10 classes)
    # CIFAR-style ResNet-18 forward is ~0.56 GFLOPs (multiply-adds x 2 = 1.1 GFLOP); training ~3x forward.
    assert 2.5e9 < flops.flops_per_sample("resnet18", config, 2) < 4.5e9


def test_resnet18_takes_one_training_step_on_tiny_images():
    config = {"channels": 3, "height": 8, "width": 8, "num_classes": 3, "base_width": 16}
    X, y = zoo.get_template("resnet18").example_batch(config, 4, seed=1)
    model = fresh_model("resnet18", config, X, y)
    before = model.head.weight.detach().clone()

    result = train("resnet18", model, X, y, batch_size=4)

    assert result.steps == 1 and not torch.equal(before, result.state_dict["head.weight"])


def test_shards_carry_images_regression_targets_and_token_ids():
    images, classes = torch.rand(4, 3, 5, 5), torch.tensor([0, 1, 2, 1])
    rows, targets = torch.randn(4, 3), torch.tensor([1.5, -2.0, 0.25, 9.0])
    tokens = torch.randint(0, 9, (4, 6))

    for X, y in ((images, classes), (rows, targets), (tokens, tokens.roll(-1, 1))):
        X2, y2 = bytes_to_shard(shard_to_bytes(X, y))
        assert torch.equal(X2, X) and torch.equal(y2, y) and X2.dtype == X.dtype and y2.dtype == y.dtype
    with pytest.raises(BadShard, match="token ids"):
        bytes_to_shard(state_dict_to_bytes({"X": tokens, "y": tokens[:, :3]}))
    with pytest.raises(BadShard):
        bytes_to_shard(state_dict_to_bytes({"X": torch.rand(4, 3, 5), "y": classes}))


def test_lora_state_holds_only_the_adapters_and_an_untrained_adapter_changes_nothing():
    base = zoo.init_state("transformer", {k: v for k, v in TINY["lora"].items() if k not in ("rank", "alpha")}, 1)
    lora = zoo.build_model("lora", TINY["lora"])
    lora.load_state_dict(zoo.init_state("lora", TINY["lora"], 2))
    zoo.load_base(lora, base)
    plain = zoo.build_model("transformer", {k: v for k, v in TINY["lora"].items() if k not in ("rank", "alpha")})
    plain.load_state_dict(base)
    ids = torch.randint(0, 11, (2, 8))

    assert all(k.endswith((".lora_a", ".lora_b")) for k in lora.state_dict())
    assert torch.allclose(lora(ids), plain(ids), atol=1e-6)  # B starts at zero
    assert zoo.lm_config_from_base(base, heads=2) == {k: v for k, v in TINY["lora"].items()
                                                      if k not in ("rank", "alpha")}
    with pytest.raises(zoo.InvalidModelConfig, match="missing"):
        zoo.load_base(lora, {k: v for k, v in base.items() if k != "head.weight"})


@pytest.mark.parametrize("template", sorted(TINY))
def test_the_quote_counts_exactly_the_flops_a_unit_does(template):
    X, y = _tiny_data(template)
    model = fresh_model(template, TINY[template], X, y)
    hp = zoo.validate_hparams(template, {"batch_size": 8})
    per_sample = flops.flops_per_sample(template, TINY[template], 8)
    forward = flops.forward_flops_per_sample(template, TINY[template], 8)
    counter = FlopCounterMode(display=False)

    with counter:  # training, plus the receipt's loss before and after
        train(template, model, X, y, batch_size=8)

    assert counter.get_total_flops() == flops.unit_flops(per_sample, len(y), hp["epochs"], forward)


def test_a_language_models_predictions_are_made_a_few_thousand_tokens_at_a_time(monkeypatch):
    """predict, like evaluate, runs _EVAL_CHUNK tokens a pass, not _EVAL_CHUNK windows of `context` tokens each (at
    the default 8,192 windows of 128 tokens that was a million tokens' logits at once); same predictions."""
    X, _ = zoo.get_template("transformer").example_batch(TINY["transformer"], 10, seed=3)  # 10 windows of 8 tokens
    model = zoo.build_model("transformer", TINY["transformer"])
    whole = training.predict(model, X)
    passes: list[int] = []
    model.register_forward_hook(lambda module, inputs, output: passes.append(inputs[0].shape[0]))
    monkeypatch.setattr(training, "_EVAL_CHUNK", 16)  # 2 windows a pass

    assert torch.equal(training.predict(model, X), whole)
    assert passes == [2, 2, 2, 2, 2]


TASK_CONFIGS = {**TINY, "mlp-regression": {"in_features": 6, "hidden": [8], "task": "regression"}}


@pytest.mark.parametrize("name", sorted(TASK_CONFIGS))
@pytest.mark.parametrize("chunk", [training._EVAL_CHUNK, 5])  # whole, and in chunks (the sums add up the same way)
def test_loss_on_is_exactly_evaluates_loss_for_every_task_and_leaves_the_mode_alone(name, chunk, monkeypatch):
    template = name.split("-")[0]
    spec = zoo.get_template(template)
    X, y = spec.example_batch(TASK_CONFIGS[name], 24, seed=3)
    model = fresh_model(template, TASK_CONFIGS[name], X, y)
    train(template, model, X, y, seed=5, batch_size=8)  # trained weights, not the initial ones
    monkeypatch.setattr(training, "_EVAL_CHUNK", chunk)

    for mode in (True, False):
        model.train(mode)
        assert training.loss_on(model, X, y) == training.evaluate(model, X, y)["loss"], (name, mode)
        assert model.training is mode and all(m.training is mode for m in model.modules())
