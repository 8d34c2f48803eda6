"""The single mapping between parameter paths and checkpoint tensor names (FLINT_SPEC sections 3 and 4).

A parameter path names one position of the `Params` tree that holds a weight (an array or a whole `NVFP4Weight`):
`embed`, `layers.3.attn.q`, `layers.3.mlp.gate`, `final_norm`, `lm_head`. `entries(cfg)` lists them in tree
order with their shape, kind and checkpoint names; `assemble` and `flatten` go between `Params` and
`{path: value}` dicts. Every converter module gets names from here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import jax

from flint_jax.config import FlintConfig
from flint_jax.nvfp4 import NVFP4Weight
from flint_jax.params import Leaf, Params, WeightFormat, describe

# Params attribute path (after `layers.N.`) -> (GGUF base name after `blk.N.`, HF name after `model.layers.N.`).
_LAYER_NAMES: dict[str, tuple[str, str]] = {
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
    "attn.q": ("attn_q.weight", "self_attn.q_proj.weight"),
    "attn.k": ("attn_k.weight", "self_attn.k_proj.weight"),
    "attn.v": ("attn_v.weight", "self_attn.v_proj.weight"),
    "attn.o": ("attn_output.weight", "self_attn.o_proj.weight"),
    "attn.q_norm": ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    "attn.k_norm": ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    "attn.sinks": ("attn_sinks.weight", "self_attn.sinks"),
    "mlp_norm": ("ffn_norm.weight", "post_attention_layernorm.weight"),
}
_DENSE_NAMES = {
    "mlp.gate": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "mlp.up": ("ffn_up.weight", "mlp.up_proj.weight"),
    "mlp.down": ("ffn_down.weight", "mlp.down_proj.weight"),
}
_MOE_NAMES = {
    "mlp.router": ("ffn_gate_inp.weight", "mlp.gate.weight"),
    "mlp.router_bias": ("exp_probs_b.bias", "mlp.gate.e_score_correction_bias"),
    "mlp.gate": ("ffn_gate_exps.weight", "mlp.experts.{e}.gate_proj.weight"),
    "mlp.up": ("ffn_up_exps.weight", "mlp.experts.{e}.up_proj.weight"),
    "mlp.down": ("ffn_down_exps.weight", "mlp.experts.{e}.down_proj.weight"),
    "mlp.shared_gate": ("ffn_gate_shexp.weight", "mlp.shared_experts.gate_proj.weight"),
    "mlp.shared_up": ("ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight"),
    "mlp.shared_down": ("ffn_down_shexp.weight", "mlp.shared_experts.down_proj.weight"),
}
_TOP_NAMES = {
    "embed": ("token_embd.weight", "model.embed_tokens.weight"),
    "final_norm": ("output_norm.weight", "model.norm.weight"),
    "lm_head": ("output.weight", "lm_head.weight"),
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One weight of the model. `hf` has one name, or one per expert for a stacked expert tensor."""
    path: str
    shape: tuple[int, ...]
    kind: str  # Leaf.kind: linear, embed, norm, sink, router, bias
    dtype: object  # the Params dtype of a non-NVFP4 value (bf16 or f32)
    gguf: str
    hf: tuple[str, ...]
    optional: bool = False  # may be absent from a checkpoint (router bias -> zeros; tied lm_head -> embedding)
    experts: int = 0  # number of stacked experts along dim 0 (0: an ordinary tensor)

    @property
    def linear(self) -> bool:
        """A linear weight: may be NVFP4 (the embedding is a lookup table, so always an array)."""
        return self.kind == "linear"

    @property
    def gguf_scale_names(self) -> tuple[str, str]:
        """Where a GGUF file may keep this weight's FP32 global scale (FLINT_SPEC section 4)."""
        base = self.gguf.removesuffix(".weight")
        return base + ".scale", self.gguf + ".scale"


def keypath_str(kp) -> str:
    out = []
    for k in kp:
        if isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(str(k.idx))
        elif isinstance(k, jax.tree_util.DictKey):
            out.append(str(k.key))
        else:
            raise TypeError(f"unexpected key {k!r}")
    return ".".join(out)


def _is_leaf(x) -> bool:
    return isinstance(x, Leaf)


def _names(path: str, cfg: FlintConfig) -> tuple[str, str]:
    if path in _TOP_NAMES:
        return _TOP_NAMES[path]
    _, n, rest = path.split(".", 2)
    table = _LAYER_NAMES if rest in _LAYER_NAMES else (_MOE_NAMES if cfg.is_moe(int(n)) else _DENSE_NAMES)
    g, h = table[rest]
    return f"blk.{n}.{g}", f"model.layers.{n}.{h}"


def entries(cfg: FlintConfig) -> list[Entry]:
    """Every weight of the model for `cfg`, in `Params` tree order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(describe(cfg), is_leaf=_is_leaf)
    out = []
    for kp, leaf in flat:
        path = keypath_str(kp)
        g, h = _names(path, cfg)
        experts = leaf.shape[0] if "{e}" in h else 0
        hf = tuple(h.format(e=e) for e in range(experts)) if experts else (h,)
        optional = leaf.kind == "bias" or (path == "lm_head" and cfg.tie_word_embeddings)
        out.append(Entry(path, leaf.shape, leaf.kind, leaf.dtype, g, hf, optional, experts))
    return out


def flatten(params: Params) -> dict[str, object]:
    """`{path: value}` where a value is an array or a whole NVFP4Weight."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, NVFP4Weight))
    out: dict[str, object] = {}
    for kp, v in flat:
        out[keypath_str(kp)] = v
    return out


def assemble(cfg: FlintConfig, value: Callable[[str], object] | dict, weights: WeightFormat = "bf16") -> Params:
    """Build `Params` by asking `value(path)` (or looking up a dict) for every entry, in tree order. The values
    decide each linear's format; `weights` only shapes the template."""
    get = value.__getitem__ if isinstance(value, dict) else value

    def one(kp, leaf):
        return get(keypath_str(kp))
    return jax.tree_util.tree_map_with_path(one, describe(cfg, weights), is_leaf=_is_leaf)


def gguf_names(cfg: FlintConfig) -> dict[str, Entry]:
    return {e.gguf: e for e in entries(cfg)}


def iter_hf_names(cfg: FlintConfig) -> Iterator[tuple[str, Entry, int | None]]:
    """(HF tensor name, its entry, expert index or None) for every HF tensor of the model."""
    for e in entries(cfg):
        for i, name in enumerate(e.hf):
            yield name, e, (i if e.experts else None)


# ---- GGUF metadata (FLINT_SPEC section 4) --------------------------------------------------------------------------
ARCH = "flint"
SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID

# metadata key (after "flint.") -> (config field or None, value type). Types follow llama.cpp: u32 counts, f32
# reals, bool flags. `expert_gating_func`, `attention.value_length` and `expert_shared_feed_forward_length` carry
# facts the config states in another form; `eos_token_ids` (ours) keeps the config's whole stop list.
GGUF_KEYS: dict[str, tuple[str | None, str]] = {
    "vocab_size": ("vocab_size", "u32"),
    "context_length": ("max_position_embeddings", "u32"),
    "embedding_length": ("hidden_size", "u32"),
    "block_count": ("num_hidden_layers", "u32"),
    "feed_forward_length": ("intermediate_size", "u32"),
    "expert_feed_forward_length": ("moe_intermediate_size", "u32"),
    "expert_shared_feed_forward_length": (None, "u32"),
    "leading_dense_block_count": ("first_k_dense_replace", "u32"),
    "expert_count": ("n_routed_experts", "u32"),
    "expert_used_count": ("num_experts_per_tok", "u32"),
    "expert_shared_count": ("n_shared_experts", "u32"),
    "expert_weights_scale": ("routed_scaling_factor", "f32"),
    "expert_weights_norm": ("norm_topk_prob", "bool"),
    "expert_gating_func": (None, "u32"),
    "attention.head_count": ("num_attention_heads", "u32"),
    "attention.head_count_kv": ("num_key_value_heads", "u32"),
    "attention.key_length": ("head_dim", "u32"),
    "attention.value_length": (None, "u32"),
    "attention.layer_norm_rms_epsilon": ("rms_norm_eps", "f32"),
    "attention.sliding_window": ("sliding_window", "u32"),
    "attention.sliding_window_pattern": ("layer_types", "bool[]"),
    "rope.freq_base": ("rope_theta", "f32"),
    "eos_token_ids": ("eos_token_id", "u32[]"),
}


def gguf_metadata(cfg: FlintConfig) -> dict[str, tuple[object, str]]:
    """`{"flint.<key>": (value, type)}` for every key of GGUF_KEYS."""
    from flint_jax.config import SLIDING
    out = {}
    for key, (field, kind) in GGUF_KEYS.items():
        if key == "expert_shared_feed_forward_length":
            v = cfg.moe_intermediate_size * cfg.n_shared_experts
        elif key == "expert_gating_func":
            v = SIGMOID_GATING
        elif key == "attention.value_length":
            v = cfg.head_dim
        elif key == "attention.sliding_window_pattern":
            v = [t == SLIDING for t in cfg.layer_types]
        else:
            v = getattr(cfg, field)
            v = list(v) if isinstance(v, tuple) else v
        if kind == "u32[]" and not v:
            continue  # GGUF has no empty arrays of a known type
        out[f"{ARCH}.{key}"] = (v, kind)
    return out


def _f32(v: float) -> float:
    """An FP32 metadata value as the shortest decimal that rounds to it (1e-5, not 9.99999974738e-06)."""
    import numpy as np
    return float(repr(np.float32(v)).removeprefix("np.float32(").removesuffix(")"))


def config_fields_from_gguf(meta: dict) -> tuple[dict, list[str]]:
    """Config fields stated by `flint.*` metadata, and a list of problems (inconsistent keys). `meta` maps keys to
    plain Python values."""
    from flint_jax.config import FULL, SLIDING
    fields: dict = {}
    problems: list[str] = []
    for key, (field, kind) in GGUF_KEYS.items():
        full = f"{ARCH}.{key}"
        if full not in meta or field is None:
            continue
        v = meta[full]
        if kind == "f32":
            v = _f32(v)
        elif kind == "bool":
            v = bool(v)
        elif kind == "bool[]":
            v = tuple(SLIDING if b else FULL for b in v)
        elif kind == "u32[]":
            v = tuple(int(i) for i in v)
        else:
            v = int(v)
        fields[field] = v
    gating = meta.get(f"{ARCH}.expert_gating_func")
    if gating is not None and int(gating) != SIGMOID_GATING:
        problems.append(f"{ARCH}.expert_gating_func = {gating}: Flint routes with sigmoid ({SIGMOID_GATING})")
    vlen = meta.get(f"{ARCH}.attention.value_length")
    if vlen is not None and "head_dim" in fields and int(vlen) != fields["head_dim"]:
        problems.append(f"{ARCH}.attention.value_length = {vlen} differs from attention.key_length = "
                        f"{fields['head_dim']}: Flint has one head_dim")
    shared = meta.get(f"{ARCH}.expert_shared_feed_forward_length")
    if shared is not None and {"moe_intermediate_size", "n_shared_experts"} <= fields.keys():
        want = fields["moe_intermediate_size"] * fields["n_shared_experts"]
        if int(shared) != want:
            problems.append(f"{ARCH}.expert_shared_feed_forward_length = {shared}, but the shared expert is "
                            f"expert_feed_forward_length x expert_shared_count = {want}")
    return fields, problems
