"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3) over a paged KV pool.

Plain PyTorch that runs the same on CPU and CUDA. Parameter names follow Hugging Face's, so a
safetensors checkpoint loads as is. One forward serves a whole batch: the new tokens of every
request are concatenated into one sequence, attention reads each request's context from the
KV pool by slot, and logits are computed only where a token is sampled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from radixserve.errors import InvalidArgumentError
from radixserve.model.attention import AttentionBackend, AttentionMetadata
from radixserve.model.kv import KVPool

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-family model. `arch` is llama, qwen2 (qkv bias) or qwen3 (q/k norm)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    arch: str = "llama"

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @classmethod
    def from_hf(cls, config: dict) -> LlamaConfig:
        """Read a Hugging Face `config.json` dict; raises for architectures we do not run."""
        archs = config.get("architectures") or ["LlamaForCausalLM"]
        arch = SUPPORTED_ARCHITECTURES.get(archs[0])
        if arch is None:
            raise InvalidArgumentError(
                f"architecture {archs[0]!r} is not supported; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if config.get("mlp_bias"):
            raise InvalidArgumentError("mlp_bias=True is not supported")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        missing = [k for k in (*required, "num_attention_heads") if k not in config]
        if missing:
            raise InvalidArgumentError(f"config.json lacks {missing}")
        heads = config["num_attention_heads"]
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        theta = config.get("rope_theta", rope.get("rope_theta", 10_000.0))
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
            arch=arch,
        )

    def num_parameters(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the config's scaling applied."""
    dim = config.head_dim
    # float32, computed as Hugging Face does, so positions rotate identically.
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise InvalidArgumentError(f"rope scaling type {kind!r} is not supported")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() if dtype in (torch.float16, torch.bfloat16) else x
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [T, heads, head_dim] by per-token cos/sin [T, 1, head_dim] (rotate-half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVPool,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv.write(self.layer, meta.new_slots, k, v)
        out = backend.forward(q, kv.k[self.layer], kv.v[self.layer], meta)
        return self.o_proj(out.reshape(tokens, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, kv, meta, backend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder with its LM head. `forward` returns logits at `meta.sample_indices`."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVPool,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, kv, meta, backend)
        x = self.model.norm(x[meta.sample_indices])
        return self.lm_head(x)
