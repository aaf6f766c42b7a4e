"""ONNX export of a trained model: the zoo's own module with the job's weights, as one .onnx file.

The graph takes the same numeric tensor the torch module takes and answers what it answers, because the model's
buffers (each feature's or channel's mean and std, a regression target's mean and std) are inside it:

- `mlp`: input float32 [batch, in_features], the features as the site prepared them for training (a table's columns
  with categorical columns one-hot encoded and missing numbers filled with the training median; an image's pixels
  flattened), unscaled; output float32 [batch, classes] logits, or float32 [batch] predictions in the target's units.
- `cnn`, `resnet18`: input float32 [batch, channels, height, width], pixels in their uploaded scale (raw 0-255 for
  a zip of images), never normalised; output float32 [batch, classes] logits.
- `transformer`: input int64 [batch, length] token ids, 1 <= length <= context; output float32
  [batch, length, vocab_size], the next token's logits at every position.

The batch dimension (and a transformer's length) is dynamic; the input is named "input" and the output "output".
The same sentences, the template and its model_config (JSON) are in the model's metadata_props (`muninn_input`,
`muninn_output`, `muninn_template`, `muninn_model_config`) and its doc_string.

A `lora` job's adapters are not a model on their own: `supported("lora")` is False, and what can be exported is
the merged transformer (`zoo.merge_lora`'s state under template "transformer"), which runs without the base file.

The exporter is torch's TorchScript-based one (`dynamo=False`), not the torch.export-based default: it needs only
the `onnx` package (not onnxscript), was about thirty times faster on these templates (measured on CPU: 10-300 ms
for small models, 1-4 s for a 64-wide ResNet-18 or a 25M-parameter transformer, against 1-6 s for small models with
`dynamo=True`), and is deterministic: the same weights give the same bytes, in any process. torch deprecates it;
torch is pinned, and the tests that run every template's export in onnxruntime say when an upgrade drops it.
Needs `pip install 'muninn-worker[onnx]'`; onnx is imported only here, when a model is exported.
"""
from __future__ import annotations

import io
import json
import threading
import warnings

import torch
from torch import Tensor

from . import zoo

__all__ = ["NotExportable", "OPSET", "supported", "describe", "export"]

OPSET = 17  # run by onnxruntime >= 1.14 and most other runtimes
MAX_BYTES = 2 * 2**30 - 2**20  # one .onnx file (a protobuf) holds at most 2 GiB, weights included
EXPORTABLE = ("mlp", "cnn", "resnet18", "transformer")

# torch.onnx's TorchScript exporter keeps its settings in module globals while it runs: one export at a time.
_LOCK = threading.Lock()


class NotExportable(ValueError):
    """This template (or model) cannot be exported to ONNX, said in a sentence."""


def supported(template: str) -> bool:
    """Whether models of `template` can be exported on their own (lora adapters cannot: export the merged model)."""
    return template in EXPORTABLE


def _refuse(template: str) -> NotExportable:
    if template == "lora":
        return NotExportable("A lora job's adapters are not a model on their own: export the merged transformer "
                             "(base weights and adapters in one model) instead.")
    return NotExportable(f"Models of the {template!r} template cannot be exported to ONNX (these can: "
                         f"{', '.join(EXPORTABLE)}).")


def describe(template: str, model_config: dict) -> tuple[str, str]:
    """What the exported model takes and what it answers, in a sentence each."""
    if not supported(template):
        raise _refuse(template)
    task = zoo.task_of(template, model_config)
    if template == "transformer":
        return (f"int64 [batch, length] token ids below {model_config['vocab_size']}, length 1 to "
                f"{model_config['context']}",
                f"float32 [batch, length, {model_config['vocab_size']}] logits of the next token at each position")
    if template == "mlp":
        taken = (f"float32 [batch, {model_config['in_features']}] features as the site prepared them for training "
                 "(a table's columns with categorical columns one-hot encoded and missing numbers filled with the "
                 "training median; an image's pixels flattened), unscaled: the model standardises them itself")
    else:
        c, h, w = model_config["channels"], model_config["height"], model_config["width"]
        taken = (f"float32 [batch, {c}, {h}, {w}] pixels, channels first, in the scale they were uploaded in (raw "
                 "0-255 for a zip of images), never normalised: the model standardises each channel itself")
    if task == "regression":
        return taken, "float32 [batch] predictions in the target's units"
    return taken, f"float32 [batch, {model_config['num_classes']}] logits over the classes, in the job's class order"


def export(template: str, model_config: dict, state: dict[str, Tensor], *,
           metadata: dict[str, str] | None = None) -> bytes:
    """The model `template`/`model_config` with the weights `state`, as ONNX bytes (see the module's docstring).

    `metadata` adds string entries to the model's metadata_props (the site adds the job and its classes).
    Raises NotExportable for a template that cannot be exported or weights too large for one ONNX file, and
    zoo.InvalidModelConfig / RuntimeError (load_state_dict) when the config or the weights do not fit the template.
    """
    if not supported(template):
        raise _refuse(template)
    size = sum(t.numel() * t.element_size() for t in state.values())
    if size > MAX_BYTES:
        raise NotExportable(f"The model's weights take {size / 2**30:.1f} GiB; one ONNX file holds at most 2 GiB. "
                            "Use the safetensors download instead.")
    try:
        import onnx
    except ImportError:
        raise ImportError("ONNX export needs the onnx package: pip install 'muninn-worker[onnx]'") from None
    taken, answered = describe(template, model_config)

    model = zoo.build_model(template, model_config)
    model.load_state_dict(state, strict=True)
    model.eval()
    example, _ = zoo.get_template(template).example_batch(model_config, 2)
    axes = {0: "batch", 1: "length"} if template == "transformer" else {0: "batch"}
    buffer = io.BytesIO()
    with _LOCK, warnings.catch_warnings(), torch.no_grad():
        # The exporter warns that it is deprecated, and the tracer that Python numbers computed from shapes
        # (a head's width, an image's fixed size) become constants: they are constants of the model_config.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(model, (example,), buffer, input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": axes, "output": axes}, opset_version=OPSET, dynamo=False,
                          do_constant_folding=True)

    proto = onnx.load_from_string(buffer.getvalue())
    proto.doc_string = f"Muninn {template} model. Input: {taken}. Output: {answered}."
    props = {"muninn_template": template, "muninn_model_config": json.dumps(model_config, sort_keys=True),
             "muninn_input": taken, "muninn_output": answered, **(metadata or {})}
    del proto.metadata_props[:]
    onnx.helper.set_model_props(proto, props)
    return proto.SerializeToString(deterministic=True)
