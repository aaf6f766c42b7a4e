"""The template registry: every model family the platform trains, by name (see `zoo` for the helpers)."""

from .base import HParam, IncompatibleData, InvalidHParams, InvalidModelConfig, Template, UnknownTemplate
from .tabular import MLP
from .text import LORA, TRANSFORMER
from .vision import CNN, RESNET18

TEMPLATES: dict[str, Template] = {t.name: t for t in (MLP, CNN, RESNET18, TRANSFORMER, LORA)}

__all__ = ["TEMPLATES", "HParam", "Template", "UnknownTemplate", "InvalidHParams", "InvalidModelConfig",
           "IncompatibleData"]
