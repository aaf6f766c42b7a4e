"""Text templates: a small decoder-only transformer language model, and LoRA fine-tuning of one.

Samples are windows of token ids: X int64 [batch, context] and y int64 [batch, context], y being X shifted
by one token. The metric is perplexity, exp(mean cross-entropy per token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import (
    HParam, IncompatibleData, InvalidHParams, InvalidModelConfig, Template, config_int, config_keys, train_hparams,
)

MAX_VOCAB = 65_536
LM_KEYS = {"vocab_size", "context", "d_model", "layers", "heads"}


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # Written out (not scaled_dot_product_attention) so torch's FLOP counter sees every matmul.
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attended = scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        return self.proj(attended.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TransformerLM(nn.Module):
    """GPT-style: token + learned position embeddings, pre-norm blocks, a final norm and a Linear head."""

    task = "language_model"

    def __init__(self, vocab_size: int, context: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*[Block(d_model, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.ln_f(self.blocks(self.tok_emb(ids) + self.pos_emb(positions))))


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update: y = x W^T + b + (alpha / r) x A^T B^T (Hu et al. 2021).

    W and b are non-persistent buffers under the Linear's own names, so the state_dict holds only the
    adapters (what travels each round) while `load_base` fills W and b from the customer's base weights.
    B starts at zero, so an untrained adapter leaves the base model exactly as it was.
    """

    def __init__(self, linear: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.register_buffer("weight", linear.weight.detach(), persistent=False)
        self.register_buffer("bias", linear.bias.detach(), persistent=False)
        self.lora_a = nn.Parameter(torch.randn(rank, linear.in_features) / math.sqrt(linear.in_features))
        self.lora_b = nn.Parameter(torch.zeros(linear.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


LORA_TARGETS = ("attn.qkv", "attn.proj", "fc1", "fc2")


def to_lora(model: TransformerLM, rank: int, alpha: float) -> TransformerLM:
    """Freeze every base tensor into a non-persistent buffer and put adapters on each block's Linears."""
    for module in list(model.modules()):
        for name in list(module._parameters):
            tensor = module._parameters.pop(name)
            module.register_buffer(name, tensor.detach(), persistent=False)
    for block in model.blocks:
        for path in LORA_TARGETS:
            parent = block.attn if path.startswith("attn.") else block
            leaf = path.split(".")[-1]
            setattr(parent, leaf, LoRALinear(getattr(parent, leaf), rank, alpha))
    return model


def base_keys(model: nn.Module) -> list[str]:
    """Names of the frozen base tensors of a LoRA model (the transformer's state_dict keys)."""
    persistent = set(model.state_dict())
    return [name for name, _ in model.named_buffers() if name not in persistent]


@torch.no_grad()
def load_base(model: nn.Module, base_state: dict[str, Tensor]) -> None:
    """Copy the customer's base weights into a LoRA model's frozen buffers; names and shapes must match."""
    expected = base_keys(model)
    missing, extra = sorted(set(expected) - set(base_state)), sorted(set(base_state) - set(expected))
    if missing or extra:
        raise InvalidModelConfig(f"base weights do not fit the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name in expected:
        buffer = model.get_buffer(name)
        if base_state[name].shape != buffer.shape:
            raise InvalidModelConfig(f"base weight {name!r} has shape {list(base_state[name].shape)}; the model "
                                     f"needs {list(buffer.shape)}")
        buffer.copy_(base_state[name])


def merge_lora(model_config: dict, base_state: dict[str, Tensor], adapters: dict[str, Tensor]) -> dict[str, Tensor]:
    """The fine-tuned transformer's own state_dict: W + (alpha / r) B A for every adapted Linear."""
    scale = float(model_config["alpha"]) / int(model_config["rank"])
    merged = {name: tensor.clone() for name, tensor in base_state.items()}
    for name in adapters:
        if name.endswith(".lora_a"):
            prefix = name[: -len(".lora_a")]
            delta = adapters[f"{prefix}.lora_b"].float() @ adapters[name].float()
            merged[f"{prefix}.weight"] = (merged[f"{prefix}.weight"].float() + scale * delta).to(
                merged[f"{prefix}.weight"].dtype)
    return merged


def lm_config_from_base(base_state: dict[str, Tensor], heads: int | None = None) -> dict:
    """The transformer model_config that base weights describe, read from their shapes."""
    try:
        vocab_size, d_model = base_state["tok_emb.weight"].shape
        context = base_state["pos_emb.weight"].shape[0]
    except (KeyError, ValueError):
        raise InvalidModelConfig("base weights must be a Muninn transformer's state_dict (tok_emb.weight, "
                                 "pos_emb.weight, blocks.N..., head.weight)") from None
    layers = len({key.split(".")[1] for key in base_state if key.startswith("blocks.")})
    heads = heads or max(1, d_model // 16)
    return {"vocab_size": int(vocab_size), "context": int(context), "d_model": int(d_model), "layers": layers,
            "heads": heads}


# ------------------------------------------------------------------------------------------ templates


def _lm_shape(name: str, model_config: dict, extra: set[str] = frozenset()) -> tuple[int, int, int, int, int]:
    config_keys(name, model_config, LM_KEYS | extra)
    vocab = config_int(model_config["vocab_size"], "vocab_size", 2, MAX_VOCAB)
    context = config_int(model_config["context"], "context", 2, 4096)
    d_model = config_int(model_config["d_model"], "d_model", 8, 4096)
    layers = config_int(model_config["layers"], "layers", 1, 48)
    heads = config_int(model_config["heads"], "heads", 1, 64)
    if d_model % heads:
        raise InvalidModelConfig(f"d_model ({d_model}) must be a multiple of heads ({heads})")
    return vocab, context, d_model, layers, heads


@dataclass(frozen=True)
class TransformerTemplate(Template):
    def build(self, model_config: dict) -> nn.Module:
        return TransformerLM(*_lm_shape(self.name, model_config))

    def example_batch(self, model_config: dict, batch_size: int, *, seed: int = 0) -> tuple[Tensor, Tensor]:
        vocab, context = model_config["vocab_size"], model_config["context"]
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch_size, context + 1), generator=generator)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def model_config(self, profile: dict, hparams: dict) -> dict:
        if profile.get("kind") != "text":
            raise IncompatibleData(f"The {self.name} template trains on plain text; upload a UTF-8 .txt file.")
        if hparams["d_model"] % hparams["heads"]:
            raise InvalidHParams(f"d_model ({hparams['d_model']}) must be a multiple of heads ({hparams['heads']})",
                                 field="heads")
        return {"vocab_size": profile["vocab_size"], "context": hparams["context"], "d_model": hparams["d_model"],
                "layers": hparams["layers"], "heads": hparams["heads"]}


@dataclass(frozen=True)
class LoRATemplate(TransformerTemplate):
    def build(self, model_config: dict) -> nn.Module:
        _lm_shape(self.name, model_config, {"rank", "alpha"})
        rank = config_int(model_config["rank"], "rank", 1, 256)
        alpha = model_config["alpha"]
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1024:
            raise InvalidModelConfig(f"alpha must be a number in (0, 1024] (got {alpha!r})")
        base = TransformerLM(*_lm_shape(self.name, {k: model_config[k] for k in LM_KEYS}))
        return to_lora(base, rank, float(alpha))

    def model_config(self, profile: dict, hparams: dict) -> dict:
        """`profile` is the text's; the base model's config comes in profile["base_model_config"]."""
        if profile.get("kind") != "text":
            raise IncompatibleData("LoRA fine-tunes a transformer on plain text; upload a UTF-8 .txt file.")
        base = profile.get("base_model_config")
        if not base:
            raise IncompatibleData("LoRA needs base weights: upload a transformer's .safetensors and pass its "
                                   "dataset id as base_weights.")
        if profile["vocab_size"] > base["vocab_size"]:
            raise IncompatibleData(f"The text has {profile['vocab_size']} distinct tokens but the base model knows "
                                   f"{base['vocab_size']}; upload the text with the base model's tokenizer "
                                   "(byte-level fits every 256-token base).")
        return {**base, "rank": hparams["rank"], "alpha": hparams["alpha"]}


TRANSFORMER = TransformerTemplate(
    name="transformer",
    title="Small transformer language model",
    description="A GPT-style decoder (pre-norm blocks, learned positions) trained from scratch on your text, "
                "byte- or character-level. Reports perplexity on held-out text.",
    tasks=("language_model",),
    data=("text",),
    optimizer="adam",
    hparams=(
        HParam("d_model", "int", 64, 16, 1024, "Width of the model (a multiple of heads)."),
        HParam("layers", "int", 2, 1, 12, "Number of transformer blocks."),
        HParam("heads", "int", 4, 1, 16, "Attention heads per block."),
        HParam("context", "int", 64, 8, 512, "Tokens per training window."),
        *train_hparams(1, 32, 3e-3, lr_max=1.0, momentum=None),
    ),
)

LORA = LoRATemplate(
    name="lora",
    title="LoRA fine-tuning of a transformer",
    description="Fine-tunes uploaded transformer base weights (safetensors) on your text with low-rank "
                "adapters: only the adapters train and travel; you get them and the merged model.",
    tasks=("language_model",),
    data=("text",),
    optimizer="adam",
    needs_base=True,
    hparams=(
        HParam("rank", "int", 8, 1, 64, "Rank of each adapter."),
        HParam("alpha", "float", 16.0, 1.0, 256.0, "Adapter scale numerator (the update is alpha/rank · BA)."),
        *train_hparams(1, 32, 3e-3, lr_max=1.0, momentum=None),
    ),
)
