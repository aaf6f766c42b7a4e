"""Image templates: a small CNN for any device and the ResNet-18 layout for the GPU tier.

Both take float32 images [batch, channels, height, width] and standardise each channel with buffers the
site fills from the training split (like the MLP's), so the downloaded model takes raw pixels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .base import HParam, IncompatibleData, InvalidModelConfig, Template, config_int, config_keys, train_hparams

MAX_SIDE = 512
MAX_CLASSES = 100_000


class _ChannelNorm(nn.Module):
    """(x - mean[c]) / std[c] with per-channel buffers."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(channels))
        self.register_buffer("std", torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        return (x - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1)


def _windows(size: int, out: int) -> list[tuple[int, int]]:
    """The [start, end) rows of each of `out` cells, as adaptive average pooling divides `size` rows."""
    return [(i * size // out, -(-(i + 1) * size // out)) for i in range(out)]


class _AdaptiveMean(nn.Module):
    """`nn.AdaptiveAvgPool2d((out_h, out_w))` (the same windows) built from slices and means: the CUDA
    backward of `AdaptiveAvgPool2d` has no deterministic implementation (`torch.use_deterministic_algorithms`
    refuses it), while those of slicing and `mean` are deterministic. A rectangle's mean is the mean over its
    columns of the means over its rows, so the rows are pooled first, then the columns. No state.

    When the cells tile the map exactly (every power-of-two image size) it is one reshape and one mean."""

    def __init__(self, out_h: int, out_w: int) -> None:
        super().__init__()
        self.out_h, self.out_w = out_h, out_w

    @staticmethod
    def _pool(x: Tensor, dim: int, out: int) -> Tensor:
        if out == x.shape[dim]:  # one cell per row: nothing to average
            return x
        cells = [x.narrow(dim, start, end - start).mean(dim) for start, end in _windows(x.shape[dim], out)]
        return torch.stack(cells, dim=dim)

    def forward(self, x: Tensor) -> Tensor:
        n, c, h, w = x.shape
        if h % self.out_h == 0 and w % self.out_w == 0:
            cells = x.reshape(n, c, self.out_h, h // self.out_h, self.out_w, w // self.out_w)
            return cells.mean(dim=(3, 5))
        return self._pool(self._pool(x, 2, self.out_h), 3, self.out_w)


class SmallCNN(nn.Module):
    """[conv 3x3 → ReLU → max-pool 2] per filter width, an average pool to at most 4x4 (the windows of
    adaptive average pooling), a Linear head."""

    task = "classification"

    def __init__(self, channels: int, height: int, width: int, num_classes: int, filters: list[int]) -> None:
        super().__init__()
        self.norm = _ChannelNorm(channels)
        layers: list[nn.Module] = []
        c, h, w = channels, height, width
        for f in filters:
            layers += [nn.Conv2d(c, f, 3, padding=1), nn.ReLU()]
            if min(h, w) >= 2:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            c = f
        self.features = nn.Sequential(*layers)
        self.pool = _AdaptiveMean(min(h, 4), min(w, 4))
        self.head = nn.Linear(c * min(h, 4) * min(w, 4), num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.pool(self.features(self.norm(x))).flatten(1))


def _groups(channels: int) -> int:
    # GroupNorm instead of BatchNorm: FedAvg over batch statistics of different shards is not a statistic of
    # anything (Hsieh et al. 2020); group norm has no running buffers and the same parameters.
    return math.gcd(32, channels)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(_groups(c_out), c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(_groups(c_out), c_out)
        # Each block starts as the identity (Goyal et al. 2017, "zero-γ"): at lr 0.01 a width-64 network still blew
        # its held-out loss up from 1.4 to 3.4 in the first epoch without it, and with it honest drift between two
        # devices' arithmetic over a 4-step segment fell from ~5e-4 to ~5e-6.
        nn.init.zeros_(self.norm2.weight)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                          nn.GroupNorm(_groups(c_out), c_out))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        return self.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """The ResNet-18 layout (He et al. 2016): a stem, four stages of two basic blocks with widths w, 2w, 4w,
    8w (w = 64 is the original), global average pooling and a Linear head. Images under 64 px get the
    CIFAR stem (3x3, stride 1, no max-pool), larger ones the ImageNet stem (7x7 stride 2, max-pool)."""

    task = "classification"

    def __init__(self, channels: int, height: int, width: int, num_classes: int, base_width: int) -> None:
        super().__init__()
        self.norm = _ChannelNorm(channels)
        w = base_width
        if min(height, width) >= 64:
            self.stem = nn.Sequential(nn.Conv2d(channels, w, 7, stride=2, padding=3, bias=False),
                                      nn.GroupNorm(_groups(w), w), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        else:
            self.stem = nn.Sequential(nn.Conv2d(channels, w, 3, padding=1, bias=False), nn.GroupNorm(_groups(w), w),
                                      nn.ReLU())
        stages, c_in = [], w
        for i, c_out in enumerate((w, 2 * w, 4 * w, 8 * w)):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)))
            c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(8 * w, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        # Global average pooling, spelled as the mean torch turns AdaptiveAvgPool2d(1) into: other adaptive
        # output sizes have no deterministic CUDA backward, so no AdaptiveAvgPool2d appears in these models.
        return self.head(self.stages(self.stem(self.norm(x))).mean(dim=(2, 3)))


# ------------------------------------------------------------------------------------------ templates


@dataclass(frozen=True)
class _ImageTemplate(Template):
    _extra_key = ""

    def _shape(self, model_config: dict) -> tuple[int, int, int, int]:
        config_keys(self.name, model_config, {"channels", "height", "width", "num_classes", self._extra_key})
        return (config_int(model_config["channels"], "channels", 1, 4),
                config_int(model_config["height"], "height", 1, MAX_SIDE),
                config_int(model_config["width"], "width", 1, MAX_SIDE),
                config_int(model_config["num_classes"], "num_classes", 2, MAX_CLASSES))

    def example_batch(self, model_config: dict, batch_size: int, *, seed: int = 0) -> tuple[Tensor, Tensor]:
        c, h, w, k = self._shape(model_config)
        generator = torch.Generator().manual_seed(seed)
        return (torch.randn(batch_size, c, h, w, generator=generator),
                torch.randint(0, k, (batch_size,), generator=generator))

    def model_config(self, profile: dict, hparams: dict) -> dict:
        if profile.get("kind") != "image" or "image_shape" not in profile:
            raise IncompatibleData(f"The {self.name} template trains on images (a zip of class folders, or an "
                                   ".npz whose X is a stack of images); this dataset is not one.")
        if profile.get("task", "classification") != "classification":
            raise IncompatibleData(f"The {self.name} template classifies images; the target must be classes.")
        c, h, w = profile["image_shape"]
        if profile.get("resizable"):  # a zip of images is decoded at the template's size
            h = w = hparams["image_size"]
        return {"channels": c, "height": h, "width": w, "num_classes": profile["num_classes"]}

    def fit_state(self, state: dict[str, Tensor], X: Tensor, y: Tensor) -> dict[str, Tensor]:
        X = X.to(torch.float32)
        std = X.transpose(0, 1).reshape(X.shape[1], -1).std(dim=1)
        state["norm.mean"] = X.mean(dim=(0, 2, 3))
        state["norm.std"] = torch.where(std > 1e-6, std, torch.ones_like(std))
        return state


@dataclass(frozen=True)
class CNNTemplate(_ImageTemplate):
    _extra_key = "filters"

    def build(self, model_config: dict) -> nn.Module:
        c, h, w, k = self._shape(model_config)
        filters = model_config["filters"]
        if not isinstance(filters, (list, tuple)) or not 1 <= len(filters) <= 4:
            raise InvalidModelConfig("filters must be a list of 1 to 4 channel counts")
        return SmallCNN(c, h, w, k, [config_int(f, f"filters[{i}]", 1, 512) for i, f in enumerate(filters)])

    def model_config(self, profile: dict, hparams: dict) -> dict:
        return {**super().model_config(profile, hparams), "filters": hparams["filters"]}


@dataclass(frozen=True)
class ResNetTemplate(_ImageTemplate):
    _extra_key = "base_width"

    def build(self, model_config: dict) -> nn.Module:
        c, h, w, k = self._shape(model_config)
        return ResNet18(c, h, w, k, config_int(model_config["base_width"], "base_width", 8, 128))

    def model_config(self, profile: dict, hparams: dict) -> dict:
        return {**super().model_config(profile, hparams), "base_width": hparams["base_width"]}


_IMAGE_SIZE_HELP = "Side in pixels that the images of a zip are resized to (an .npz keeps its own shape)."

CNN = CNNTemplate(
    name="cnn",
    title="Small convolutional network",
    description="Up to four 3x3 convolution + max-pool blocks and a linear classifier: for small images "
                "(digits, icons, thumbnails). Trains on CPUs.",
    tasks=("classification",),
    data=("image",),
    hparams=(
        HParam("filters", "int_list", (16, 32), 1, 512, "Channels of each convolution block (1 to 4 blocks).",
               max_items=4),
        HParam("image_size", "int", 32, 4, 256, _IMAGE_SIZE_HELP),
        *train_hparams(2, 32, 0.05),
    ),
)

RESNET18 = ResNetTemplate(
    name="resnet18",
    title="ResNet-18",
    description="The ResNet-18 layout (four stages of two residual blocks, group-normalised for federated "
                "averaging) for larger images. GPU tier.",
    tasks=("classification",),
    data=("image",),
    tier="gpu",
    hparams=(
        HParam("base_width", "int", 64, 8, 128, "Channels of the first stage (64 is the original ResNet-18)."),
        HParam("image_size", "int", 64, 16, 256, _IMAGE_SIZE_HELP),
        # lr 0.01: at 0.05 a base_width 32 model on 480 32-px shape images blew its loss up from 1.29 to 4-5 in
        # its first epoch (measured); at 0.01 the loss falls on shapes and on synthetic images alike.
        *train_hparams(1, 64, 0.01),
    ),
)
