"""Robust aggregation rules on tiny hand-made tensors."""
import pytest
import torch

from muninn_worker.federated.aggregation import AggregationError
from muninn_worker.federated.robust import aggregate, coordinate_median, norm_clipped_fedavg, trimmed_mean, update_norms


def states(*rows):
    return [{"w": torch.tensor(r, dtype=torch.float32), "n": torch.tensor([i])} for i, r in enumerate(rows)]


def test_trimmed_mean_drops_the_extremes_per_coordinate():
    got = trimmed_mean(states([1.0, 10.0], [2.0, -50.0], [3.0, 11.0], [100.0, 12.0], [4.0, 13.0]), trim=0.2)
    # per coordinate drop one smallest and one largest: [2,3,4] -> 3 ; [10,11,12] -> 11
    assert torch.equal(got["w"], torch.tensor([3.0, 11.0]))
    assert torch.equal(got["n"], torch.tensor([0]))


def test_trimming_too_much_is_an_error():
    with pytest.raises(AggregationError):
        trimmed_mean(states([1.0], [2.0]), trim=0.5)


def test_median_odd_and_even():
    assert torch.equal(coordinate_median(states([1.0], [100.0], [2.0]))["w"], torch.tensor([2.0]))
    assert torch.equal(coordinate_median(states([1.0], [100.0], [2.0], [3.0]))["w"], torch.tensor([2.5]))


def test_median_ignores_a_minority_of_huge_values():
    honest = [[1.0, 1.0]] * 4
    got = coordinate_median(states(*honest, [1e9, -1e9]))
    assert torch.equal(got["w"], torch.tensor([1.0, 1.0]))


def test_norm_clipping_bounds_a_scaled_update():
    glob = {"w": torch.zeros(2), "n": torch.tensor([0])}
    ups = states([1.0, 0.0], [0.0, 1.0], [300.0, 400.0])  # norms 1, 1, 500
    assert update_norms(ups, glob) == [1.0, 1.0, 500.0]

    got = norm_clipped_fedavg(ups, [1, 1, 1], glob)

    # the 500-norm update is scaled to the median norm 1: [0.6, 0.8]
    assert torch.allclose(got["w"], torch.tensor([(1 + 0 + 0.6) / 3, (0 + 1 + 0.8) / 3]))


def test_rules_agree_with_fedavg_on_identical_updates():
    glob = {"w": torch.zeros(3), "n": torch.tensor([0])}
    same = states([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    for rule in ("fedavg", "trimmed_mean", "median", "norm_clip"):
        assert torch.allclose(aggregate(rule, same, [1, 2, 3], glob)["w"], torch.tensor([1.0, 2.0, 3.0])), rule


def test_chunked_order_statistics_match_torch_on_a_large_tensor():
    g = torch.Generator().manual_seed(0)
    big = [{"w": torch.randn(300_001, generator=g)} for _ in range(5)]
    expected = torch.stack([s["w"] for s in big]).median(dim=0).values
    assert torch.equal(coordinate_median(big)["w"], expected)


def test_unknown_rule_is_an_error():
    with pytest.raises(AggregationError, match="unknown"):
        aggregate("mean-ish", states([1.0]), [1], {"w": torch.zeros(1), "n": torch.tensor([0])})
