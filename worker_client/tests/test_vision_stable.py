"""The image templates train the same way everywhere and do not blow up: their pooling is the adaptive average
pooling it replaces, with a backward CUDA can run deterministically, and ResNet-18's default learning rate
and momentum bring the training loss down on small shape datasets without a spike."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from muninn_worker import training, zoo
from muninn_worker.samples import synthetic_images
from muninn_worker.templates.vision import _AdaptiveMean

SIZES = [(7, 7), (5, 9), (8, 8), (6, 4), (3, 2), (13, 10)]


@pytest.mark.parametrize("height, width", SIZES)
def test_window_mean_equals_adaptive_average_pooling_forward_and_backward(height, width):
    x = torch.randn(3, 5, height, width, generator=torch.Generator().manual_seed(height * 31 + width),
                    requires_grad=True)
    for out in ((min(height, 4), min(width, 4)), (4, 4), (1, 1), (3, 2)):
        expected, got = nn.AdaptiveAvgPool2d(out)(x), _AdaptiveMean(*out)(x)
        upstream = torch.randn_like(expected)
        (grad_expected,) = torch.autograd.grad(expected, x, upstream)
        (grad_got,) = torch.autograd.grad(got, x, upstream)

        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=1e-6), (out, (got - expected).abs().max())
        assert torch.allclose(grad_got, grad_expected, atol=1e-6), out


@pytest.mark.parametrize("height, width", [(28, 28), (20, 36), (32, 32)])  # feature maps 7x7, 5x9, 8x8
def test_small_cnn_gives_what_it_gave_with_adaptive_pooling(height, width):
    config = {"channels": 3, "height": height, "width": width, "num_classes": 5, "filters": [4, 6]}
    model = zoo.build_model("cnn", config)
    model.load_state_dict(zoo.init_state("cnn", config, 3))
    features_h, features_w = height // 4, width // 4  # after two max-pools
    x = torch.rand(4, 3, height, width) * 255
    with torch.no_grad():
        adaptive = nn.AdaptiveAvgPool2d((min(features_h, 4), min(features_w, 4)))
        expected = model.head(adaptive(model.features(model.norm(x))).flatten(1))

        assert torch.allclose(model(x), expected, atol=1e-6)


def test_resnet18_pools_globally_as_adaptive_pooling_to_one_cell_did():
    config = {"channels": 3, "height": 20, "width": 12, "num_classes": 4, "base_width": 8}
    model = zoo.build_model("resnet18", config)
    model.load_state_dict(zoo.init_state("resnet18", config, 2))
    x = torch.rand(3, 3, 20, 12) * 255
    with torch.no_grad():
        expected = model.head(nn.AdaptiveAvgPool2d(1)(model.stages(model.stem(model.norm(x)))).flatten(1))

        assert torch.allclose(model(x), expected, atol=1e-6)


def test_image_models_keep_their_saved_keys_and_hold_no_adaptive_pooling():
    cnn = zoo.build_model("cnn", {"channels": 1, "height": 28, "width": 28, "num_classes": 10, "filters": [16, 32]})
    resnet = zoo.build_model("resnet18", {"channels": 3, "height": 32, "width": 32, "num_classes": 3,
                                          "base_width": 8})

    assert list(cnn.state_dict()) == ["norm.mean", "norm.std", "features.0.weight", "features.0.bias",
                                      "features.3.weight", "features.3.bias", "head.weight", "head.bias"]
    assert list(resnet.state_dict())[:5] == ["norm.mean", "norm.std", "stem.0.weight", "stem.1.weight", "stem.1.bias"]
    assert list(resnet.state_dict())[-2:] == ["head.weight", "head.bias"]
    for model in (cnn, resnet):
        assert not any(isinstance(m, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)) for m in model.modules())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the CPU backward of every op is deterministic")
@pytest.mark.parametrize("template, config", [
    ("cnn", {"channels": 3, "height": 28, "width": 28, "num_classes": 3, "filters": [8, 16]}),
    ("resnet18", {"channels": 3, "height": 32, "width": 32, "num_classes": 3, "base_width": 8}),
])
def test_image_templates_train_on_cuda_with_deterministic_algorithms(template, config, monkeypatch):
    X, y = zoo.get_template(template).example_batch(config, 16, seed=0)
    runs = []
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS matmuls
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            model = zoo.build_model(template, config).cuda()
            model.load_state_dict(zoo.init_state(template, config, 0))
            runs.append(training.train_local(model, X, y, epochs=1, batch_size=8, lr=0.01, momentum=0.9, seed=1))
    finally:
        torch.use_deterministic_algorithms(False)

    assert all(torch.equal(runs[0].state_dict[k], runs[1].state_dict[k]) for k in runs[0].state_dict)


def _shape_images(per_class: int, size: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Circles, squares and triangles as raw 0-255 RGB pixels, channel first: the newcomer's class-folder zip."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    images, labels = [], []
    for label in range(3):
        for _ in range(per_class):
            r = int(rng.integers(5, 12))
            cx, cy = rng.integers(r, size - r, 2)
            if label == 0:
                mask = (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
            elif label == 1:
                mask = (abs(xx - cx) <= r) & (abs(yy - cy) <= r)
            else:
                mask = (yy >= cy - r) & (yy <= cy + r) & (abs(xx - cx) <= (yy - (cy - r)) / 2)
            image = np.zeros((size, size), np.float32)
            image[mask] = 255
            images.append(np.stack([image] * 3))
            labels.append(label)
    return torch.tensor(np.array(images)), torch.tensor(labels)


@pytest.mark.parametrize("data", ["shapes", "synthetic"])
def test_resnet18_trains_stably_with_its_default_hyper_parameters(data):
    if data == "shapes":
        X, y = _shape_images(per_class=160)
    else:
        images, labels = synthetic_images(seed=3, per_class=160, size=32)
        X, y = torch.tensor(images, dtype=torch.float32), torch.tensor(labels)
        X = X[:, None] if X.ndim == 3 else X.permute(0, 3, 1, 2)
    defaults = {h.name: h.default for h in zoo.get_template("resnet18").hparams}
    config = {"channels": X.shape[1], "height": 32, "width": 32, "num_classes": int(y.max()) + 1, "base_width": 32}
    model = zoo.build_model("resnet18", config)
    model.load_state_dict(zoo.get_template("resnet18").fit_state(zoo.init_state("resnet18", config, 0), X, y))
    torch.manual_seed(0)
    epoch_losses = []

    result = training.train_local(model, X, y, epochs=2, batch_size=defaults["batch_size"], lr=defaults["lr"],
                                  momentum=defaults["momentum"], seed=1,
                                  progress=lambda epoch, epochs, loss: epoch_losses.append(loss))

    assert result.loss_after < result.loss_before, (result.loss_before, result.loss_after, epoch_losses)
    assert max(epoch_losses) < 1.5 * result.loss_before, epoch_losses  # at lr 0.05 the first epoch ran to 4-5
