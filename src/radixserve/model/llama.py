"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3) over a paged KV pool.

Plain PyTorch that runs the same on CPU and CUDA. One forward serves a whole batch: the new
tokens of every request are concatenated into one sequence, attention reads each request's
context from the KV pool by slot, and logits are computed only where a token is sampled.

Projections are stored input-major (`weight_t` is [in, out]) with q/k/v and gate/up fused into
one matrix each: on CPU a one-token decode then streams each weight once, in order, which
measured 1.2x faster than `nn.Linear`'s [out, in] layout (bench/engine.py, part d).
`from_hf_state_dict` and `hf_state_dict` convert from and to Hugging Face's names and layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from radixserve.errors import InvalidArgumentError
from radixserve.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    single_query_attention,
)
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
        if dtype in (torch.float16, torch.bfloat16):  # normalise in float32, as HF does
            x = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x.to(dtype)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [T, heads, head_dim] by per-token cos/sin [T, 1, head_dim] (rotate-half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class InputMajorLinear(nn.Module):
    """y = x @ weight_t + bias, with `weight_t` stored [in_features, out_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)


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
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self.qkv_proj = InputMajorLinear(h, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = InputMajorLinear(self.q_size, h)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim] and k, v [T, kv_heads, head_dim] of x, rotated."""
        tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(tokens, self.heads + 2 * self.kv_heads, self.head_dim)
        qk, v = qkv[:, : self.heads + self.kv_heads], qkv[:, self.heads + self.kv_heads :]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, : self.heads]), self.k_norm(qk[:, self.heads :])], 1)
        qk = apply_rope(qk, cos, sin)  # q and k heads in one go
        return qk[:, : self.heads], qk[:, self.heads :], v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVPool,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        kv.wait_layer(self.layer)  # pages a tier loads into this layer land first
        kv.write(self.layer, meta.new_slots, k, v)
        out = backend.forward(q, kv.k[self.layer], kv.v[self.layer], meta)
        return self.o_proj(out.reshape(x.shape[0], self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.intermediate = i
        self.gate_up_proj = InputMajorLinear(h, 2 * i)
        self.down_proj = InputMajorLinear(i, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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

    # Every layer runs the same code on its own weights: compiled as one nested region,
    # inductor generates it once instead of once per layer (minutes of compiling less).
    @torch.compiler.nested_compile_region
    def decode(self, x, cos, sin, k_layer, v_layer, context_slots, context_mask):
        """`LlamaForCausalLM.decode_step` for this layer: x out, and the new k and v stacked
        [2, B, kv_heads, head_dim] (a fresh tensor: a compiled region that returns views of
        its own buffers hands back memory it reuses)."""
        attn = self.self_attn
        q, k, v = attn.project(self.input_layernorm(x), cos, sin)
        out = single_query_attention(
            q, k_layer[context_slots], v_layer[context_slots], k, v, context_mask
        )
        x = x + attn.o_proj(out.reshape(x.shape[0], attn.heads * attn.head_dim))
        return x + self.mlp(self.post_attention_layernorm(x)), torch.stack([k, v])


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
        # A tied LM head is a transposed copy of the embedding, for the same reason as above.
        self.lm_head = InputMajorLinear(config.hidden_size, config.vocab_size)
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

    def decode_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context_slots: torch.Tensor,
        context_mask: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode step of B requests that reads the KV pool and writes nothing.

        Request b's new token `input_ids[b]` at `positions[b]` attends over the slots
        `context_slots[b]` where `context_mask[b]` is set, then over itself. `k_cache` and
        `v_cache` are `KVPool.k` and `KVPool.v` ([layers, slots, kv_heads, head_dim]). Returns
        the logits [B, vocab] and the new keys and values [layers, B, kv_heads, head_dim],
        which the caller stores at the requests' new slots. Free of side effects, so that
        `torch.compile` can take the whole step as one graph (`radixserve.model.compiled`).
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        new_kv = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer.decode(x, cos, sin, k_cache[i], v_cache[i], context_slots, context_mask)
            new_kv.append(kv)
        logits = self.lm_head(self.model.norm(x))
        stacked = torch.stack(new_kv)  # [layers, 2, B, kv_heads, head_dim]
        return logits, stacked[:, 0], stacked[:, 1]


FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def from_hf_state_dict(config: LlamaConfig, tensors: dict[str, torch.Tensor]) -> dict:
    """Hugging Face names and [out, in] weights -> this module's fused, input-major ones.

    Takes each tensor it uses out of `tensors`, so that a source the conversion copies is
    freed as soon as it is copied instead of living beside its copy until the end. Raises
    `InvalidArgumentError` naming a missing tensor.
    """

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise InvalidArgumentError(f"the checkpoint lacks tensor {name}")
        return tensors.pop(name)

    out = {
        "model.embed_tokens.weight": take("model.embed_tokens.weight"),
        "model.norm.weight": take("model.norm.weight"),
    }
    head = tensors.pop("lm_head.weight", None)
    if head is None or config.tie_word_embeddings:
        head = out["model.embed_tokens.weight"]
    out["lm_head.weight_t"] = head.t().contiguous()
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{pre}{norm}.weight"] = take(f"{pre}{norm}.weight")
        for block, fused in (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj")):
            parts = [take(f"{pre}{block}.{p}.weight") for p in FUSED_PROJECTIONS[fused]]
            out[f"{pre}{block}.{fused}.weight_t"] = torch.cat(parts, dim=0).t().contiguous()
        if config.attention_bias:
            biases = [take(f"{pre}self_attn.{p}.bias") for p in FUSED_PROJECTIONS["qkv_proj"]]
            out[f"{pre}self_attn.qkv_proj.bias"] = torch.cat(biases)
        for block, name in (("self_attn", "o_proj"), ("mlp", "down_proj")):
            out[f"{pre}{block}.{name}.weight_t"] = (
                take(f"{pre}{block}.{name}.weight").t().contiguous()
            )
        if config.qk_norm:
            for norm in ("q_norm", "k_norm"):
                out[f"{pre}self_attn.{norm}.weight"] = take(f"{pre}self_attn.{norm}.weight")
    return out


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """This model's weights under Hugging Face's names and layout (e.g. to build an HF model)."""
    config, state = model.config, model.state_dict()
    out = {k: v for k, v in state.items() if not k.endswith(("weight_t", "qkv_proj.bias"))}
    out["lm_head.weight"] = state["lm_head.weight_t"].t().contiguous()
    d = config.head_dim
    sizes = {
        "qkv_proj": [config.num_attention_heads * d, *[config.num_key_value_heads * d] * 2],
        "gate_up_proj": [config.intermediate_size] * 2,
    }
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        for block, fused in (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj")):
            weight = state[f"{pre}{block}.{fused}.weight_t"].t()
            for name, part in zip(
                FUSED_PROJECTIONS[fused], weight.split(sizes[fused]), strict=True
            ):
                out[f"{pre}{block}.{name}.weight"] = part.contiguous()
        if config.attention_bias:
            bias = state[f"{pre}self_attn.qkv_proj.bias"]
            for name, part in zip(
                FUSED_PROJECTIONS["qkv_proj"], bias.split(sizes["qkv_proj"]), strict=True
            ):
                out[f"{pre}self_attn.{name}.bias"] = part
        for block, name in (("self_attn", "o_proj"), ("mlp", "down_proj")):
            out[f"{pre}{block}.{name}.weight"] = (
                state[f"{pre}{block}.{name}.weight_t"].t().contiguous()
            )
    return out
