"""FLOPs are counted by torch and scale linearly; memory estimates follow the documented formula."""

from __future__ import annotations

import torch

from muninn_worker.flops import flops_per_sample, peak_memory_bytes, unit_flops

CONFIG = {"in_features": 64, "num_classes": 10, "hidden": [128]}


def test_flops_per_sample_counts_forward_and_backward_matmuls():
    # forward 2*in*out per layer; backward 2*in*out for the weight grads plus 2*in*out for the input grads,
    # except the first layer, whose input needs no gradient.
    expected = 2 * 64 * 128 * 2 + 2 * 128 * 10 * 3

    assert flops_per_sample("mlp", CONFIG, batch_size=32) == expected


def test_flops_per_sample_is_positive_and_grows_with_the_model():
    small = flops_per_sample("mlp", CONFIG, 8)
    large = flops_per_sample("mlp", {**CONFIG, "hidden": [256, 256]}, 8)

    assert 0 < small < large


def test_unit_flops_is_linear_in_samples_and_epochs():
    per_sample = flops_per_sample("mlp", CONFIG, 32)

    assert unit_flops(per_sample, 479, 2) == per_sample * 479 * 2
    assert unit_flops(per_sample, 958, 2) == 2 * unit_flops(per_sample, 479, 2)
    assert unit_flops(per_sample, 479, 6) == 3 * unit_flops(per_sample, 479, 2)
    assert unit_flops(per_sample, 0, 2) == 0


def test_peak_memory_follows_the_documented_formula():
    params = 64 * 128 + 128 + 128 * 10 + 10
    buffers = 2 * 64
    activations_per_sample = 2 * 64 + 128 + 128 + 10  # raw + normalised input, Linear, ReLU, Linear outputs

    assert peak_memory_bytes("mlp", CONFIG, 32) == 4 * (3 * params + buffers) + 4 * 2 * 32 * activations_per_sample


def test_peak_memory_grows_with_the_batch():
    assert peak_memory_bytes("mlp", CONFIG, 64) > peak_memory_bytes("mlp", CONFIG, 32) > 0


def test_flops_are_counted_even_inside_no_grad():
    with torch.no_grad():
        inside = flops_per_sample("mlp", CONFIG, 32)

    assert inside == flops_per_sample("mlp", CONFIG, 32)


def test_unit_flops_adds_the_receipts_two_evaluation_passes():
    assert unit_flops(10, 5, 2, forward_flops_per_sample=3) == 5 * (10 * 2 + 2 * 3)


def test_transformer_memory_counts_the_attention_scores_which_grow_with_the_square_of_the_context():
    def activations(context: int) -> int:  # per sample: the batch-dependent part of the estimate
        config = {"vocab_size": 50, "context": context, "d_model": 32, "layers": 1, "heads": 4}
        return (peak_memory_bytes("transformer", config, 2) - peak_memory_bytes("transformer", config, 1)) // 8

    short, long = activations(64), activations(256)

    assert long > 4 * short  # linear terms alone would give exactly 4x
    assert long - 4 * short >= 4 * (4 * 256 * 256 - 4 * 4 * 64 * 64) // 2  # scores and probabilities, 4 heads


def test_diloco_unit_flops_count_inner_steps_of_one_batch_each():
    assert unit_flops(10, 500, 2, 3, inner_steps=7, batch_size=32) == 10 * 7 * 32 + 500 * 2 * 3
    assert unit_flops(10, 20, 2, 3, inner_steps=7, batch_size=32) == 10 * 7 * 20 + 20 * 2 * 3  # shard < batch
