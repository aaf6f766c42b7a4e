"""Base weights for LoRA: a safetensors file of a transformer's state_dict (never a pickle)."""
from __future__ import annotations

import json
import struct

from muninn_worker import tensors, zoo

from .common import DatasetError, ParsedDataset


def parse_weights(data: bytes) -> ParsedDataset:
    try:
        state = tensors.bytes_to_state_dict(data)
    except tensors.NotSafetensors as exc:
        raise DatasetError("bad_weights", f"The weights are not a valid safetensors file: {exc}") from None
    try:
        config = zoo.lm_config_from_base(state, heads=_heads(data))
        model = zoo.build_model("transformer", config)
        expected = model.state_dict()
    except (zoo.InvalidModelConfig, ValueError) as exc:
        raise DatasetError("bad_weights", f"These weights are not a Muninn transformer: {exc}") from None
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or extra or wrong:
        raise DatasetError("bad_weights", "These weights do not fit the transformer template: missing "
                           f"{missing[:5]}, unexpected {extra[:5]}, wrong shapes {wrong[:5]}.",
                           missing=missing[:20], unexpected=extra[:20], wrong_shape=wrong[:20])
    if not all(t.is_floating_point() for t in state.values()):
        raise DatasetError("bad_weights", "Every base weight must be a floating-point tensor.")
    state = {k: v.float() for k, v in state.items()}
    profile = {"format": "weights", "kind": "weights", "template": "transformer", "model_config": config,
               "tensors": len(state), "parameters": int(sum(t.numel() for t in state.values()))}
    return ParsedDataset(X=None, y=None, feature_names=[], classes=[], profile=profile, tensors=state)


def _heads(data: bytes) -> int | None:
    """Attention heads cannot be read from shapes; Muninn's model download records them in the metadata."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        metadata = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
        heads = int(json.loads(metadata.get("muninn_model_config", "{}")).get("heads", 0))
    except (ValueError, TypeError, struct.error, AttributeError):
        return None
    return heads or None
