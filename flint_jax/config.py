"""Flint model configuration: every number the model needs, validated once.

Field names follow the Hugging Face `config.json` of FLINT_SPEC section 3, so `from_hf` is a plain mapping.
The config is a frozen, hashable dataclass: it is a static argument of every jitted function.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Literal

SLIDING = "sliding_attention"
FULL = "full_attention"
LayerType = Literal["sliding_attention", "full_attention"]


class ConfigError(ValueError):
    """A Flint config that cannot describe a working model; the message names the field."""


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """FLINT_SPEC's assumed pattern: layer i is full-context when i % 7 is 3 or 6, else sliding."""
    return tuple(FULL if i % 7 in (3, 6) else SLIDING for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class FlintConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    sliding_window: int
    layer_types: tuple[str, ...]
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        # Lists from JSON become tuples so the config stays hashable (a jit static argument).
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        eos = self.eos_token_id
        object.__setattr__(self, "eos_token_id", tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),))
        self.validate()

    # ---- validation -------------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, field: str, why: str):
            if not cond:
                raise ConfigError(f"invalid Flint config: {field}: {why}")

        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
                  "num_experts_per_tok", "max_position_embeddings"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f, f"must be a positive integer, got {v!r}")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_attention_heads",
             f"{self.num_attention_heads} is not divisible by num_key_value_heads={self.num_key_value_heads}")
        need(self.head_dim % 2 == 0, "head_dim", f"must be even for rotate-half RoPE, got {self.head_dim}")
        need(isinstance(self.sliding_window, int) and self.sliding_window >= 1, "sliding_window",
             f"must be >= 1, got {self.sliding_window!r}")
        need(len(self.layer_types) == self.num_hidden_layers, "layer_types",
             f"has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}")
        for i, t in enumerate(self.layer_types):
            need(t in (SLIDING, FULL), f"layer_types[{i}]", f"must be {SLIDING!r} or {FULL!r}, got {t!r}")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             f"top-k {self.num_experts_per_tok} exceeds n_routed_experts={self.n_routed_experts}")
        need(0 <= self.first_k_dense_replace <= self.num_hidden_layers, "first_k_dense_replace",
             f"must be in [0, num_hidden_layers], got {self.first_k_dense_replace}")
        need(self.n_shared_experts in (0, 1), "n_shared_experts", f"0 or 1 supported, got {self.n_shared_experts}")
        need(self.scoring_func == "sigmoid", "scoring_func", f"only 'sigmoid' is Flint's, got {self.scoring_func!r}")
        need(self.rms_norm_eps > 0, "rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        need(self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        need(self.sliding_window <= self.max_position_embeddings, "sliding_window",
             "must not exceed max_position_embeddings")
        for e in self.eos_token_id:
            need(0 <= e < self.vocab_size, "eos_token_id", f"{e} is outside the vocabulary [0, {self.vocab_size})")
        # Kernel layout: NVFP4 packs 64 values per block along the input dimension.
        for f in ("hidden_size", "intermediate_size", "moe_intermediate_size"):
            need(getattr(self, f) % 64 == 0, f, f"must be a multiple of 64 (NVFP4 block), got {getattr(self, f)}")
        need((self.num_attention_heads * self.head_dim) % 64 == 0, "num_attention_heads*head_dim",
             "must be a multiple of 64 (NVFP4 block)")

    # ---- derived facts ----------------------------------------------------------------------------------
    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_sliding(i))

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_sliding(i))

    def replace(self, **changes: Any) -> "FlintConfig":
        return dataclasses.replace(self, **changes)

    # ---- presets ----------------------------------------------------------------------------------------
    @classmethod
    def flint(cls, **overrides: Any) -> "FlintConfig":
        """The full Flint shape (FLINT_SPEC section 1)."""
        n = overrides.pop("num_hidden_layers", 49)
        base = dict(vocab_size=151552, hidden_size=2048, num_hidden_layers=n, num_attention_heads=32,
                    num_key_value_heads=4, head_dim=128, intermediate_size=10240, moe_intermediate_size=512,
                    n_routed_experts=256, num_experts_per_tok=6, n_shared_experts=1, first_k_dense_replace=2,
                    sliding_window=513, layer_types=default_layer_types(n), max_position_embeddings=262144,
                    eos_token_id=(151329, 151336, 151338), pad_token_id=151329)
        base.update(overrides)
        return cls(**base)

    @classmethod
    def tiny(cls, **overrides: Any) -> "FlintConfig":
        """Small enough for CPU tests, yet with every feature: 2 dense + 3 MoE layers, sliding (window 5, so the
        ring wraps within a few tokens) and full layers, GQA 4/2, a shared expert, top-2 of 8 experts."""
        n = overrides.pop("num_hidden_layers", 5)
        base = dict(vocab_size=256, hidden_size=64, num_hidden_layers=n, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, intermediate_size=128, moe_intermediate_size=64,
                    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=2,
                    sliding_window=5, layer_types=(SLIDING, FULL, SLIDING, SLIDING, FULL)[:n] if n <= 5
                    else default_layer_types(n), max_position_embeddings=512, eos_token_id=(0,), pad_token_id=0)
        base.update(overrides)
        return cls(**base)

    # ---- I/O --------------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> "FlintConfig":
        """Read a Hugging Face config.json (a path to the file or its folder, or the parsed dict)."""
        if isinstance(path_or_dict, dict):
            raw, where = dict(path_or_dict), "config dict"
        else:
            p = os.fspath(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            where = p
            try:
                with open(p, encoding="utf-8") as f:
                    raw = json.load(f)
            except FileNotFoundError:
                raise ConfigError(f"{p}: no config.json found") from None
            except json.JSONDecodeError as e:
                raise ConfigError(f"{p}: not valid JSON ({e})") from None
        if raw.get("model_type", "flint") != "flint":
            raise ConfigError(f"{where}: model_type is {raw.get('model_type')!r}, expected 'flint'")
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        kwargs = {k: v for k, v in raw.items() if k in names}
        if "layer_types" not in kwargs and "num_hidden_layers" in kwargs:
            kwargs["layer_types"] = default_layer_types(kwargs["num_hidden_layers"])
        missing = sorted(required - kwargs.keys())
        if missing:
            raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}")
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    def to_hf(self) -> dict:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["eos_token_id"] = list(self.eos_token_id)
        return {"model_type": "flint", "architectures": ["FlintForCausalLM"], **d}
