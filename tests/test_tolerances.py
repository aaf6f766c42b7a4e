"""The calibrated table of segment lengths and tolerances (contributors/data/tolerances.json, written by
bench/verification.py): complete, sane, and right about a real mlp segment. Pure: no database."""
from __future__ import annotations

import pytest
import torch
from muninn_worker import training, zoo
from muninn_worker.segments import Checkpoint
from sklearn.datasets import load_digits

from contributors import tolerances
from contributors.checks import checkpoint_distance

WARMUP = 10  # steps before the measured segment: a mid-training start, momentum built up


def test_every_template_of_the_zoo_has_a_segment_length_and_an_envelope():
    templates = tolerances.table()["templates"]

    assert set(zoo.TEMPLATES) <= set(templates)
    for name in zoo.TEMPLATES:
        assert tolerances.segment_steps(name) >= 1
        assert templates[name]["envelope"], name
        assert all(float(v) >= 0 for v in templates[name]["envelope"].values()), name


def test_tolerance_is_at_least_the_floor_and_never_shrinks_as_segments_grow():
    floor = float(tolerances.table()["floor"])

    for name in zoo.TEMPLATES:
        values = [tolerances.tolerance(name, k) for k in range(1, 65)]
        assert min(values) >= floor, name
        assert values == sorted(values), name


@pytest.fixture(scope="module")
def mlp_segments():
    """Three mlp units on digits, each at a mid-training start: the validator's segment of k steps (native),
    the same segment in another device's arithmetic (numerics="f64") and the segment with its last step
    skipped. [(start, validator, honest, skipped)]."""
    digits = load_digits()
    X, y = torch.tensor(digits.data, dtype=torch.float32), torch.tensor(digits.target)
    hp = zoo.validate_hparams("mlp", {})
    config = {"in_features": 64, "num_classes": 10, "hidden": hp["hidden"]}
    k = tolerances.segment_steps("mlp")
    args = {"epochs": hp["epochs"], "batch_size": hp["batch_size"], "lr": hp["lr"], "momentum": hp["momentum"],
            "optimizer": "sgd"}
    out = []
    for unit in range(3):
        rows = torch.randperm(len(y), generator=torch.Generator().manual_seed(unit))[:480]
        Xu, yu = X[rows], y[rows]
        state = zoo.get_template("mlp").fit_state(zoo.init_state("mlp", config, unit), Xu, yu)
        model = zoo.build_model("mlp", config)
        model.load_state_dict(state)
        begin = Checkpoint(state, training.initial_optimizer_state(model, "sgd", hp["momentum"]))
        start, _ = training.train_segment(model, Xu, yu, begin, first_step=0, steps=WARMUP, seed=unit, **args)

        def segment(steps: int, numerics: str = "native") -> Checkpoint:
            if steps == 0:
                return start
            end, _ = training.train_segment(model, Xu, yu, start, first_step=WARMUP, steps=steps, seed=unit,
                                            numerics=numerics, **args)
            return end

        out.append((start, segment(k), segment(k, "f64"), segment(k - 1)))
    return k, out


def test_honest_mlp_segments_in_another_devices_arithmetic_are_within_tolerance(mlp_segments):
    k, segments = mlp_segments
    tolerance = tolerances.tolerance("mlp", k)

    distances = [checkpoint_distance(honest, validator, start) for start, validator, honest, _ in segments]

    assert all(0 < d <= tolerance for d in distances), (distances, tolerance)


def test_an_mlp_segment_with_a_skipped_step_is_beyond_tolerance(mlp_segments):
    k, segments = mlp_segments
    tolerance = tolerances.tolerance("mlp", k)

    distances = [checkpoint_distance(skipped, validator, start) for start, validator, _, skipped in segments]

    assert all(d > tolerance for d in distances), (distances, tolerance)


def _moved(state: dict, start: dict, name: str, rows: slice, relative: float) -> dict:
    """`state` with the rows `rows` of tensor `name` moved by `relative` × the segment's update norm."""
    update = sum(float((state[k].double() - start[k].double()).pow(2).sum()) for k in state
                 if state[k].is_floating_point()) ** 0.5
    moved = dict(state)
    tensor = state[name].clone()
    block = tensor[rows]
    tensor[rows] = block + relative * update / block.numel() ** 0.5
    moved[name] = tensor
    return moved


def test_one_row_moved_as_a_relu_flip_moves_it_passes_but_the_same_move_spread_over_every_row_fails(mlp_segments):
    # Under other rounding one sample can cross a ReLU's kink: its gradient then moves one hidden unit's row by
    # 1e-4..1e-2 of the update while every other row agrees (bench/verification.py, TAIL_TEMPLATES). Every cheat
    # moves all rows.
    k, segments = mlp_segments
    tolerance = tolerances.tolerance("mlp", k)
    start, validator, honest, _ = segments[0]
    name = "layers.0.weight"

    one_row = Checkpoint(_moved(honest.weights, start.weights, name, slice(7, 8), 1e-2), honest.optimizer)
    every_row = Checkpoint(_moved(honest.weights, start.weights, name, slice(None), 1e-2), honest.optimizer)
    too_far = Checkpoint(_moved(honest.weights, start.weights, name, slice(7, 8), 0.2), honest.optimizer)

    assert checkpoint_distance(one_row, validator, start) <= tolerance
    assert checkpoint_distance(every_row, validator, start) > 100 * tolerance
    # beyond the spared rows' cap: the whole distance counts
    assert checkpoint_distance(too_far, validator, start) > 0.1


def test_a_browser_segment_is_judged_against_the_larger_of_its_measured_envelope_and_the_templates(monkeypatch):
    table = {"multiple": 10, "floor": 1e-5,
             "templates": {"mlp": {"segment_steps": 8, "envelope": {"8": 2e-6, "32": 1e-5}}},
             "browser": {"templates": {"mlp": {"envelope": {"8": 5e-6, "32": 4e-6}}}}}
    monkeypatch.setattr(tolerances, "table", lambda: table)

    assert tolerances.tolerance("mlp", 8) == pytest.approx(2e-5)
    assert tolerances.tolerance("mlp", 8, backend="browser") == pytest.approx(5e-5)
    assert tolerances.tolerance("mlp", 32, backend="browser") == pytest.approx(1e-4)
    assert tolerances.tolerance("mlp", 8, backend="cpu") == pytest.approx(2e-5)
