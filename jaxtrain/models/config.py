"""LlamaConfig: the hyper-parameters of the Llama family (Llama 2/3, Mistral, Qwen2/3).

Field names follow Hugging Face's ``LlamaConfig`` so that an HF ``config.json`` maps onto
this dataclass key for key (the importer only renames what HF renamed itself).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

ROPE_TYPES = ("default", "linear", "llama3")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
HIDDEN_ACTS = ("silu",)

# Keys each rope type needs in `rope_scaling`, beyond the type itself.
_ROPE_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass
class LlamaConfig:
    """Architecture of a decoder-only Llama-style transformer.

    Defaults describe a tiny model (about 5.3M parameters) that trains on a laptop CPU.
    ``num_key_value_heads=None`` means multi-head attention; ``head_dim=None`` means
    ``hidden_size // num_attention_heads``. Both are resolved in ``__post_init__``.
    """

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # q/k/v bias (Qwen2 style). HF Llama's attention_bias=True also biases o_proj, which
    # this model does not have: an importer must reject such checkpoints.
    attention_bias: bool = False
    mlp_bias: bool = False
    # Per-head RMSNorm of queries and keys over head_dim before RoPE (Qwen3 style).
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    model_type: str = "llama"

    # What this config class accepts; subclasses for other families (models/moe.py,
    # models/gemma.py) widen them.
    SUPPORTED_MODEL_TYPES: ClassVar[tuple[str, ...]] = MODEL_TYPES
    SUPPORTED_HIDDEN_ACTS: ClassVar[tuple[str, ...]] = HIDDEN_ACTS

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        ):
            _check_positive_int(name, getattr(self, name))
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        _check_positive_int("num_key_value_heads", self.num_key_value_heads)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads}); choose num_key_value_heads "
                "as a divisor of num_attention_heads."
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); set head_dim explicitly or change one of them."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        _check_positive_int("head_dim", self.head_dim)
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim ({self.head_dim}) must be even for rotary embeddings; use an even "
                "head_dim."
            )
        if self.hidden_act not in self.SUPPORTED_HIDDEN_ACTS:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} is not supported; use one of "
                f"{self.SUPPORTED_HIDDEN_ACTS}."
            )
        for name in ("initializer_range", "rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}.")
        if self.sliding_window is not None:
            _check_positive_int("sliding_window", self.sliding_window)
        if self.model_type not in self.SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported by {type(self).__name__}; "
                f"use one of {self.SUPPORTED_MODEL_TYPES}."
            )
        for name in ("attention_bias", "mlp_bias", "qk_norm", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        self.rope_scaling = _validate_rope_scaling(self.rope_scaling)

    def __hash__(self) -> int:
        # Modules keep the config as static graph data, which NNX hashes (jit cache keys).
        # Treat a config as a value: do not mutate it after building a model from it.
        return hash(_freeze(self.to_dict()))

    # ---------------------------------------------------------------- derived values
    @property
    def rope_type(self) -> str:
        """The rope type, "default" when rope_scaling is None."""
        if self.rope_scaling is None:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def num_parameters(self) -> int:
        """Exact parameter count of LlamaForCausalLM built from this config."""
        d, v, f = self.hidden_size, self.vocab_size, self.intermediate_size
        n, k, h = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        qkv_out = (n + 2 * k) * h  # q: n heads, k and v: k heads each
        attn = d * qkv_out + n * h * d + (qkv_out if self.attention_bias else 0)
        mlp = 3 * d * f + ((2 * f + d) if self.mlp_bias else 0)
        layer = attn + mlp + 2 * d  # two RMSNorm weights
        if self.qk_norm:
            layer += 2 * h  # q_norm and k_norm weights
        head = 0 if self.tie_word_embeddings else d * v
        return v * d + self.num_hidden_layers * layer + d + head

    # ---------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of all fields (resolved values, e.g. head_dim filled in)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                value = dict(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, strict: bool = True) -> LlamaConfig:
        """Build a config from a dict; unknown keys raise unless ``strict=False``."""
        if not isinstance(d, dict):
            raise ValueError(f"LlamaConfig.from_dict expects a dict, got {type(d).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in d if k not in known)
        if unknown and strict:
            raise ValueError(
                f"unknown LlamaConfig field(s) {unknown}; remove them or pass strict=False to "
                f"ignore them. Known fields: {sorted(known)}."
            )
        return cls(**{k: v for k, v in d.items() if k in known})


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def _validate_rope_scaling(rope_scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, dict):
        raise ValueError(
            f"rope_scaling must be None or a dict with a 'rope_type' key, got {rope_scaling!r}."
        )
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if rope_type is None:
        raise ValueError(
            f"rope_scaling={rope_scaling!r} has no 'rope_type' (or 'type') key; add one of "
            f"{ROPE_TYPES}."
        )
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"rope_scaling rope_type={rope_type!r} is not supported; use one of {ROPE_TYPES} "
            "or set rope_scaling=None."
        )
    missing = [k for k in _ROPE_REQUIRED_KEYS[rope_type] if k not in rope_scaling]
    if missing:
        raise ValueError(
            f"rope_scaling of rope_type {rope_type!r} is missing key(s) {missing}; add them."
        )
    if (
        rope_type == "llama3"
        and rope_scaling["high_freq_factor"] <= rope_scaling["low_freq_factor"]
    ):
        raise ValueError(
            "rope_scaling high_freq_factor must be greater than low_freq_factor for llama3 rope."
        )
    if "factor" in rope_scaling and rope_scaling["factor"] <= 0:
        raise ValueError(f"rope_scaling factor must be positive, got {rope_scaling['factor']!r}.")
    out = dict(rope_scaling)
    out["rope_type"] = rope_type  # normalise the legacy "type" key
    return out


def two_tower_config(cls: type, d: dict[str, Any], text: type, vision: type, what: str) -> Any:
    """A vision-language config `cls` from its `to_dict` dict (a run's model section): the
    decoder's `text` section read by `text.from_dict`, the tower's `vision` by `vision(**...)`,
    the rest `cls`'s own fields; ValueError naming `what` for anything else."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown or not isinstance(d.get("text"), dict) or not isinstance(d.get("vision"), dict):
        raise ValueError(
            f"a {what} config has the sections 'text' and 'vision' and the fields "
            f"{sorted(known - {'text', 'vision'})}; got {sorted(d)}"
        )
    return cls(**{**d, "text": text.from_dict(d["text"]), "vision": vision(**d["vision"])})


class DecoderFields:
    """A vision-language config (a dataclass with a `text` decoder config): what it lacks
    (vocab_size, hidden_size, layers, heads, bos/eos/pad ids...) is its decoder's."""

    def __getattr__(self, name: str) -> Any:
        if name in ("text", "__setstate__") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.text, name)
