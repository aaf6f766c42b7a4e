"""FedAvg on tiny hand-made state dicts: the arithmetic, the dtypes, and the inputs it refuses."""

import pytest
import torch

from muninn_worker.federated.aggregation import CHUNK_BYTES, AggregationError, fedavg


def test_fedavg_weights_each_client_by_its_samples():
    client_a = {"w": torch.tensor([1.0, 2.0, 3.0])}
    client_b = {"w": torch.tensor([5.0, 6.0, 7.0])}

    result = fedavg([client_a, client_b], [1, 3])

    assert torch.equal(result["w"], torch.tensor([4.0, 5.0, 6.0]))


def test_fedavg_with_equal_weights_is_the_plain_mean():
    states = [{"w": torch.tensor([[0.0, 8.0]])}, {"w": torch.tensor([[2.0, 4.0]])}, {"w": torch.tensor([[4.0, 0.0]])}]

    result = fedavg(states, [7, 7, 7])

    assert torch.allclose(result["w"], torch.tensor([[2.0, 4.0]]), rtol=0, atol=1e-6)


def test_fedavg_accepts_fractional_weights():
    states = [{"w": torch.tensor([0.0])}, {"w": torch.tensor([10.0])}]

    result = fedavg(states, [0.5, 2.0])

    assert torch.equal(result["w"], torch.tensor([8.0]))


def test_one_client_gets_its_own_weights_back_bit_for_bit():
    weights = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    weights[0] = -0.0
    state = {"w": weights, "b": torch.tensor([float("nan"), 1e-45]), "steps": torch.tensor(12)}

    result = fedavg([state], [37])

    assert result.keys() == state.keys()
    for name, tensor in state.items():
        assert result[name].dtype == tensor.dtype
        assert result[name].reshape(-1).view(torch.uint8).equal(tensor.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_fedavg_returns_each_tensor_in_its_input_dtype(dtype):
    states = [{"w": torch.tensor([1.0, 2.0], dtype=dtype)}, {"w": torch.tensor([3.0, 4.0], dtype=dtype)}]

    result = fedavg(states, [1, 1])

    assert result["w"].dtype == dtype
    assert torch.equal(result["w"], torch.tensor([2.0, 3.0], dtype=dtype))


def test_half_precision_is_accumulated_in_float32():
    # Summing 1000 shares of 1/1000 in bfloat16 stalls at 0.5; a float32 accumulator gets back to 1.
    states = [{"w": torch.ones(3, dtype=torch.bfloat16)}] * 1000

    result = fedavg(states, [1] * 1000)

    assert torch.equal(result["w"], torch.ones(3, dtype=torch.bfloat16))


def test_half_precision_result_is_the_exact_average_rounded_once():
    # (2*5 + 1*1) / 3 = 3.666..., whose nearest bfloat16 is 3.671875; rounding 5 * 2/3 to bfloat16 first
    # would give 3.65625.
    states = [{"w": torch.tensor([5.0], dtype=torch.bfloat16)}, {"w": torch.tensor([1.0], dtype=torch.bfloat16)}]

    result = fedavg(states, [2, 1])

    assert result["w"].item() == 3.671875


def test_float64_is_averaged_in_float64():
    states = [{"w": torch.tensor([1.0], dtype=torch.float64)}, {"w": torch.tensor([1.0 + 2**-40], dtype=torch.float64)}]

    result = fedavg(states, [1, 1])

    assert result["w"].item() == 1.0 + 2**-41


def test_complex_tensors_are_averaged_like_floats():
    states = [{"w": torch.tensor([1 + 2j])}, {"w": torch.tensor([5 - 2j])}]

    result = fedavg(states, [1, 3])

    assert result["w"].dtype == torch.complex64
    assert torch.equal(result["w"], torch.tensor([4 - 1j]))


def test_integer_buffers_are_taken_from_the_client_with_most_samples():
    states = [
        {"w": torch.tensor([0.0]), "steps": torch.tensor([10]), "seen": torch.tensor([True])},
        {"w": torch.tensor([1.0]), "steps": torch.tensor([20]), "seen": torch.tensor([False])},
        {"w": torch.tensor([2.0]), "steps": torch.tensor([30]), "seen": torch.tensor([True])},
    ]

    result = fedavg(states, [1, 5, 2])

    assert torch.equal(result["steps"], torch.tensor([20]))
    assert torch.equal(result["seen"], torch.tensor([False]))
    assert result["steps"].dtype == torch.int64


def test_integer_buffers_on_a_tie_come_from_the_first_heaviest_client():
    states = [{"steps": torch.tensor(1)}, {"steps": torch.tensor(2)}, {"steps": torch.tensor(3)}]

    result = fedavg(states, [1, 4, 4])

    assert result["steps"].item() == 2


def test_result_keeps_the_parameter_order_of_the_first_client():
    states = [
        {"b": torch.zeros(1), "a": torch.zeros(1), "c": torch.zeros(1)},
        {"a": torch.ones(1), "c": torch.ones(1), "b": torch.ones(1)},
    ]

    result = fedavg(states, [1, 1])

    assert list(result) == ["b", "a", "c"]


def test_fedavg_leaves_inputs_untouched_and_shares_no_memory_with_them():
    states = [
        {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor([3])},
        {"w": torch.tensor([3.0, 4.0]), "n": torch.tensor([4])},
    ]
    originals = [{name: tensor.clone() for name, tensor in state.items()} for state in states]

    for result in (fedavg(states, [1, 2]), fedavg(states[:1], [1])):
        result["w"].add_(100)
        result["n"].add_(100)

    for state, original in zip(states, originals):
        assert all(torch.equal(state[name], original[name]) for name in state)


def test_non_contiguous_inputs_are_averaged_by_value():
    matrix = torch.arange(6.0).reshape(2, 3)
    states = [{"w": matrix.t()}, {"w": (matrix * 3).t()}]

    result = fedavg(states, [1, 1])

    assert torch.equal(result["w"], (matrix * 2).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_larger_than_one_chunk_matches_the_naive_weighted_sum(dtype):
    size = 3 * CHUNK_BYTES // 4 + 12_345  # several chunks and an odd tail, whatever the accumulator dtype
    assert size % 2 == 1
    generator = torch.Generator().manual_seed(0)
    samples = [3, 1, 4, 1, 5]
    states = [{"big": torch.rand(size, generator=generator).mul_(2).sub_(1).to(dtype)} for _ in samples]

    result = fedavg(states, samples)

    naive = sum(w * state["big"].double() for w, state in zip(samples, states)) / sum(samples)
    tolerance = 1e-6 if dtype == torch.float32 else 2**-8  # bfloat16's own rounding of the result
    assert result["big"].dtype == dtype
    assert torch.allclose(result["big"].double(), naive, rtol=0, atol=tolerance)


def test_empty_input_is_refused():
    with pytest.raises(AggregationError, match="no client states"):
        fedavg([], [])


def test_mismatched_parameter_names_are_refused():
    states = [{"w": torch.zeros(2), "b": torch.zeros(1)}, {"w": torch.zeros(2), "bias": torch.zeros(1)}]

    with pytest.raises(AggregationError, match=r"Client 1 .*missing \['b'\], extra \['bias'\]"):
        fedavg(states, [1, 1])


def test_mismatched_shapes_are_refused():
    states = [{"w": torch.zeros(2, 3)}, {"w": torch.zeros(3, 2)}]

    with pytest.raises(AggregationError, match=r"Client 1: 'w' has shape \(3, 2\), client 0 has \(2, 3\)"):
        fedavg(states, [1, 1])


def test_mismatched_dtypes_are_refused():
    states = [{"w": torch.zeros(2)}, {"w": torch.zeros(2, dtype=torch.float64)}]

    with pytest.raises(AggregationError, match="dtype"):
        fedavg(states, [1, 1])


def test_values_that_are_not_tensors_are_refused():
    states = [{"w": torch.zeros(2)}, {"w": [0.0, 0.0]}]

    with pytest.raises(AggregationError, match="not a tensor"):
        fedavg(states, [1, 1])


@pytest.mark.parametrize("bad_weight", [0, -3, float("nan"), float("inf"), True, "10", None])
def test_weights_that_are_not_positive_finite_numbers_are_refused(bad_weight):
    states = [{"w": torch.zeros(2)}, {"w": torch.ones(2)}]

    with pytest.raises(AggregationError, match="client 1"):
        fedavg(states, [5, bad_weight])


def test_one_weight_per_state_is_required():
    states = [{"w": torch.zeros(2)}, {"w": torch.ones(2)}]

    with pytest.raises(AggregationError, match="2 weights for 3 client states"):
        fedavg([*states, states[0]], [1, 2])


def test_aggregation_error_is_a_value_error():
    assert issubclass(AggregationError, ValueError)
