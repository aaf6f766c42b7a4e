"""The model zoo: templates, deterministic initial weights, hyper-parameter validation."""

from __future__ import annotations

import pytest
import torch

from muninn_worker.zoo import (
    TEMPLATES,
    InvalidHParams,
    InvalidModelConfig,
    UnknownTemplate,
    build_model,
    init_state,
    validate_hparams,
)

CONFIG = {"in_features": 8, "num_classes": 3, "hidden": [16, 4]}


def test_mlp_has_normalisation_buffers_and_linear_layers():
    model = build_model("mlp", CONFIG)
    state = model.state_dict()

    assert list(state) == ["norm_mean", "norm_std", "layers.0.weight", "layers.0.bias", "layers.2.weight",
                           "layers.2.bias", "layers.4.weight", "layers.4.bias"]
    assert torch.equal(state["norm_mean"], torch.zeros(8)) and torch.equal(state["norm_std"], torch.ones(8))
    assert {name for name, _ in model.named_parameters()}.isdisjoint({"norm_mean", "norm_std"})
    assert model(torch.randn(5, 8)).shape == (5, 3)


def test_mlp_normalises_its_input():
    model = build_model("mlp", {"in_features": 2, "num_classes": 2, "hidden": []})
    model.norm_mean.fill_(10.0)
    model.norm_std.fill_(2.0)
    x = torch.tensor([[12.0, 8.0]])

    expected = model.layers(torch.tensor([[1.0, -1.0]]))

    assert torch.allclose(model(x), expected)


def test_unknown_template_is_a_value_error():
    with pytest.raises(UnknownTemplate, match="'yolo'"):
        build_model("yolo", CONFIG)
    assert issubclass(UnknownTemplate, ValueError)


@pytest.mark.parametrize("config", [
    {"in_features": 0, "num_classes": 3, "hidden": []},
    {"in_features": 8, "num_classes": 1, "hidden": []},
    {"in_features": 8, "num_classes": 3, "hidden": [0]},
    {"in_features": 8, "num_classes": 3, "hidden": [8] * 5},
    {"in_features": 8, "num_classes": 3},
])
def test_bad_model_config_is_refused(config):
    with pytest.raises(InvalidModelConfig):
        build_model("mlp", config)


def test_init_state_is_deterministic_for_a_seed():
    first, again, other = init_state("mlp", CONFIG, 5), init_state("mlp", CONFIG, 5), init_state("mlp", CONFIG, 6)

    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["layers.0.weight"], other["layers.0.weight"])


def test_init_state_leaves_the_global_rng_alone():
    torch.manual_seed(99)
    expected = torch.rand(3)
    torch.manual_seed(99)

    init_state("mlp", CONFIG, 5)

    assert torch.equal(torch.rand(3), expected)


def test_validate_hparams_fills_defaults():
    assert validate_hparams("mlp", {}) == {"hidden": [128], "epochs": 2, "batch_size": 32, "lr": 0.05,
                                           "momentum": 0.9}


def test_validate_hparams_keeps_given_values():
    hparams = validate_hparams("mlp", {"hidden": [64, 32], "lr": 1, "epochs": 5})

    assert hparams["hidden"] == [64, 32] and hparams["lr"] == 1.0 and isinstance(hparams["lr"], float)
    assert hparams["epochs"] == 5


@pytest.mark.parametrize("hparams, field, bound", [
    ({"lr": 20.0}, "lr", "10"),
    ({"lr": 0.0}, "lr", "1e-05"),
    ({"epochs": 51}, "epochs", "50"),
    ({"batch_size": 0}, "batch_size", "1"),
    ({"momentum": 1.0}, "momentum", "0.999"),
    ({"hidden": [4097]}, "hidden", "4096"),
    ({"hidden": [8] * 5}, "hidden", "4"),
])
def test_validate_hparams_rejects_out_of_bounds_naming_field_and_bound(hparams, field, bound):
    with pytest.raises(InvalidHParams) as error:
        validate_hparams("mlp", hparams)

    assert error.value.field == field
    assert field in str(error.value) and bound in str(error.value)


@pytest.mark.parametrize("hparams", [{"epochs": 2.5}, {"epochs": "2"}, {"batch_size": True},
                                     {"lr": "fast"}, {"lr": float("nan")}, {"hidden": 128}, {"hidden": [1.5]}])
def test_validate_hparams_rejects_wrong_types(hparams):
    with pytest.raises(InvalidHParams):
        validate_hparams("mlp", hparams)


def test_validate_hparams_rejects_unknown_key():
    with pytest.raises(InvalidHParams, match="'dropout'") as error:
        validate_hparams("mlp", {"dropout": 0.1})

    assert error.value.field == "dropout"


def test_templates_describe_their_hparams():
    mlp = TEMPLATES["mlp"]

    assert mlp.task == "classification"
    assert [hp.name for hp in mlp.hparams] == ["hidden", "epochs", "batch_size", "lr", "momentum"]
    assert all(hp.minimum <= (min(hp.default) if hp.kind == "int_list" else hp.default) <= hp.maximum
               for hp in mlp.hparams)
