"""Train flint-tiny-demo, the small Flint that ships with flint-jax, and export it as GGUF NVFP4 and BF16.

    .venv/bin/python scripts/train_tiny.py              # train and export into flint_jax/data (docs/DEMO_MODEL.md)
    .venv/bin/python scripts/train_tiny.py --steps 50 --out /tmp/demo   # a quick smoke run elsewhere

The corpus is synthetic (flint_jax/corpus.py): GLM-4.7-style chats over three toy tools, rendered with the
project's chat template. Loss is next-token cross-entropy on what the assistant generates (reasoning, content,
tool calls and the stop marker that ends each turn). Everything is reproducible from --seed.

Speed. Every tool conversation starts with the same ~290-token tool block, which is most of its tokens. A training
batch is therefore one shared prefix (the tool block, or just `[gMASK]<sop>` for tool-free chats) and B suffixes
that attend to it: the prefix runs once per step instead of B times. `train_forward` is `model.forward` on
prefix + suffix, built from the same layer functions (checked against `model.forward` at start-up).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
import time

import flint_jax  # noqa: F401  (sets XLA_FLAGS before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

from flint_jax import corpus as C
from flint_jax import layers as L
from flint_jax import model as M
from flint_jax.chat import render
from flint_jax.config import FULL, SLIDING, FlintConfig
from flint_jax.params import Leaf, Params, describe

# Buckets (prefix kind, suffix length): a suffix is everything after the shared prefix. Longer samples are dropped.
TOOLS, PLAIN = "tools", "plain"
BUCKETS = ((TOOLS, 112), (TOOLS, 192), (PLAIN, 112))
VOCAB = 768
DEMO_FILE_STEM = "flint-tiny-demo"


def demo_config(vocab_size: int, eos: tuple[int, ...], pad: int, layers: int = 6, hidden: int = 128,
                expert: int = 64) -> FlintConfig:
    """Every Flint feature at toy scale: sliding (RoPE, window 64, so the ring wraps within one tool call) and full
    (NoPE) layers, a dense first layer, then MoE layers with sigmoid top-2 of 8 experts and a shared expert,
    Q/K norm and sinks (always present in Flint layers), GQA 4/2."""
    return FlintConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=hidden // 4, intermediate_size=3 * hidden,
                       moe_intermediate_size=expert,
                       n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                       sliding_window=64, layer_types=(SLIDING, FULL) * (layers // 2), max_position_embeddings=2048,
                       eos_token_id=eos, pad_token_id=pad)


# ---- data ------------------------------------------------------------------------------------------------------

def tool_prefix_text() -> str:
    """The rendered prompt up to the first user turn when the demo tools are offered."""
    text = render([{"role": "user", "content": "x"}], tools=C.DEMO_TOOLS)
    return text[:text.index("<|user|>")]


class Batches:
    """Fixed-shape batches grouped by prefix and suffix bucket, in a seeded order."""

    def __init__(self, tok, samples: list[C.Sample], batch: int, seed: int):
        self.prefix = {TOOLS: np.asarray(tok.encode(tool_prefix_text()), np.int32),
                       PLAIN: np.asarray(tok.encode("[gMASK]<sop>"), np.int32)}
        groups = {b: [] for b in BUCKETS}
        self.dropped = 0
        for s in samples:
            ids, target = C.encode_sample(tok, s)
            kind = TOOLS if s.text.startswith(C.tags.GMASK + C.tags.SOP + C.tags.SYSTEM) else PLAIN
            p = self.prefix[kind]
            assert np.array_equal(ids[:len(p)], p), "the prefix must tokenize the same inside a sample"
            suffix, tgt = ids[len(p):], target[len(p):]
            bucket = next(((k, n) for k, n in BUCKETS if k == kind and len(suffix) <= n), None)
            if bucket is None:
                self.dropped += 1
                continue
            groups[bucket].append((suffix, tgt))
        rng = np.random.default_rng(seed)
        self.batches = []
        for (kind, n), rows in groups.items():
            for i in range(0, len(rows) - batch + 1, batch):
                toks = np.zeros((batch, n), np.int32)
                mask = np.zeros((batch, n - 1), np.float32)
                for r, (suffix, tgt) in enumerate(rows[i:i + batch]):
                    toks[r, :len(suffix)] = suffix
                    mask[r, :len(suffix) - 1] = tgt[1:]  # position t predicts token t + 1
                self.batches.append((kind, toks, mask))
        rng.shuffle(self.batches)


# ---- model -----------------------------------------------------------------------------------------------------

def train_forward(params: Params, prefix: jax.Array, suffix: jax.Array, cfg: FlintConfig) -> jax.Array:
    """Logits [B, Ts, V] of `suffix` [B, Ts] following a shared `prefix` [Tp]: what `model.forward` gives on
    `concat(prefix, suffix[b])` at the suffix positions, with the prefix computed once for the whole batch."""
    (Tp,), (B, Ts) = prefix.shape, suffix.shape
    pos_p = jnp.arange(Tp, dtype=jnp.int32)[None]
    pos_s = jnp.broadcast_to(Tp + jnp.arange(Ts, dtype=jnp.int32), (B, Ts))
    k_pos = jnp.concatenate([jnp.broadcast_to(pos_p, (B, Tp)), pos_s], axis=1)
    hp, hs = M.embed(params, prefix[None]), M.embed(params, suffix)
    for i, layer in enumerate(params.layers):
        sliding = cfg.is_sliding(i)
        window = cfg.sliding_window if sliding else None
        qp, kp, vp = L.project_qkv(L.rmsnorm(hp, layer.attn_norm, cfg.rms_norm_eps), layer.attn, pos_p, cfg, sliding)
        qs, ks, vs = L.project_qkv(L.rmsnorm(hs, layer.attn_norm, cfg.rms_norm_eps), layer.attn, pos_s, cfg, sliding)
        kp, vp, ks, vs = (jnp.swapaxes(x, 1, 2) for x in (kp, vp, ks, vs))  # cache layout [B, KV, T, D]
        op = L.attend(qp, kp, vp, L.attention_mask(pos_p, pos_p, window), layer.attn.sinks)
        keys = jnp.concatenate([jnp.broadcast_to(kp, (B, *kp.shape[1:])), ks], axis=2)
        vals = jnp.concatenate([jnp.broadcast_to(vp, (B, *vp.shape[1:])), vs], axis=2)
        os_ = L.attend(qs, keys, vals, L.attention_mask(pos_s, k_pos, window), layer.attn.sinks)
        hp = mlp_block(hp + L.linear(op.reshape(1, Tp, -1), layer.attn.o), layer, cfg)
        hs = mlp_block(hs + L.linear(os_.reshape(B, Ts, -1), layer.attn.o), layer, cfg)
    return L.logits_from_hidden(hs, params.final_norm, params.lm_head, cfg.rms_norm_eps)


def mlp_block(h: jax.Array, layer, cfg: FlintConfig) -> jax.Array:
    """`layers.mlp_block` with the routed experts computed densely: every expert runs on every token and the
    unselected ones get weight 0. Same values and rounding points as `layers.moe_mlp` (the FP32 sum may run in
    another order), but plain matmuls: XLA's CPU ragged_dot, which the grouped path uses, is ~16x slower per FLOP
    here, so E/k = 4x the FLOPs is still about 4x faster."""
    if not hasattr(layer.mlp, "router"):
        return L.mlp_block(h, layer, cfg)
    moe = layer.mlp
    b = L.rmsnorm(h, layer.mlp_norm, cfg.rms_norm_eps)
    ids, w = L.route(b, moe.router, moe.router_bias, cfg)  # [..., K]
    dense_w = jnp.sum(jax.nn.one_hot(ids, cfg.n_routed_experts, dtype=jnp.float32) * w[..., None], axis=-2)
    gate = jnp.einsum("...h,eih->...ei", b, moe.gate, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    up = jnp.einsum("...h,eih->...ei", b, moe.up, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    out = jnp.einsum("...ei,ehi->...eh", L.swiglu(gate, up), moe.down,
                     preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    y = jnp.einsum("...e,...eh->...h", dense_w, out.astype(jnp.float32))
    if moe.shared_gate is not None:
        shared = L.linear(L.swiglu(L.linear(b, moe.shared_gate), L.linear(b, moe.shared_up)), moe.shared_down)
        y = y + shared.astype(jnp.float32)
    return h + y.astype(jnp.bfloat16)


def init_master(cfg: FlintConfig, key: jax.Array) -> Params:
    """FP32 master weights: scaled normal linears (residual outputs shrunk by depth), unit norms, zero sinks and
    router bias. The model runs on their BF16 (or FP32 router/sink) casts."""
    desc = describe(cfg)
    leaves, treedef = jax.tree.flatten(desc, is_leaf=lambda x: isinstance(x, Leaf))
    keys = jax.random.split(key, len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(desc, is_leaf=lambda x: isinstance(x, Leaf))[0]]
    out = []
    for leaf, k, path in zip(leaves, keys, paths):
        if leaf.kind in ("linear", "router"):
            std = 1.0 / math.sqrt(leaf.shape[-1])
            if path.endswith((".o", ".down", ".shared_down")):
                std /= math.sqrt(2 * cfg.num_hidden_layers)
            out.append(std * jax.random.normal(k, leaf.shape, jnp.float32))
        elif leaf.kind == "embed":
            out.append(jax.random.normal(k, leaf.shape, jnp.float32))
        elif leaf.kind == "norm":
            out.append(jnp.ones(leaf.shape, jnp.float32))
        else:  # sinks, router bias
            out.append(jnp.zeros(leaf.shape, jnp.float32))
    return jax.tree.unflatten(treedef, out)


def model_params(master: Params, cfg: FlintConfig) -> Params:
    """The master weights in the dtypes the model reads (BF16 except router, router bias and sinks)."""
    desc = describe(cfg)
    return jax.tree.map(lambda leaf, x: x.astype(leaf.dtype), desc, master,
                        is_leaf=lambda x: isinstance(x, Leaf))


# ---- training --------------------------------------------------------------------------------------------------

def make_step(cfg: FlintConfig, optimizer):
    import optax

    def loss_fn(master, prefix, toks, mask):
        logits = train_forward(model_params(master, cfg), prefix, toks[:, :-1], cfg)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    @jax.jit
    def step(master, opt_state, prefix, toks, mask):
        loss, grads = jax.value_and_grad(loss_fn)(master, prefix, toks, mask)
        updates, opt_state = optimizer.update(grads, opt_state, master)
        return optax.apply_updates(master, updates), opt_state, loss

    return step


def check_train_forward(cfg: FlintConfig, params: Params, prefix: np.ndarray, toks: np.ndarray) -> None:
    """`train_forward` must be `model.forward` on prefix + suffix (same layer functions, same rounding points).
    Sums may run in another order (the prefix attends over fewer keys), and a last-bit difference can flip a
    token's top-k experts, so the check is on the mean difference, not the maximum."""
    got = np.asarray(train_forward(params, jnp.asarray(prefix), jnp.asarray(toks[:2]), cfg))
    full = np.concatenate([np.broadcast_to(prefix, (2, len(prefix))), toks[:2]], axis=1)
    want = np.asarray(M.forward(params, jnp.asarray(full), cfg))[:, len(prefix):]
    rel = float(np.mean(np.abs(got - want)) / np.mean(np.abs(want)))
    if not rel <= 2e-2:
        if jax.default_backend() != "cpu":  # GPU matmuls of FP32 operands may use TF32: only warn there
            print(f"warning: train_forward vs model.forward: mean relative difference {rel:.3g}", file=sys.stderr)
            return
        raise AssertionError(f"train_forward differs from model.forward: mean relative difference {rel:.3g}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=800, help="optimizer steps (default: 800)")
    ap.add_argument("--batch", type=int, default=16, help="conversations per step (default: 16)")
    ap.add_argument("--layers", type=int, default=6, help="transformer layers, an even number (default: 6)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size, a multiple of 64 (default: 128)")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default: 3e-3)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "flint_jax", "data"),
                    help="folder for the GGUF files and tokenizer (default: flint_jax/data)")
    ap.add_argument("--no-export", action="store_true", help="train only (evaluate the in-memory BF16 weights)")
    ap.add_argument("--state", default=os.path.join(tempfile.gettempdir(), "flint-tiny-demo-state.npz"),
                    help="where the trained FP32 weights are saved before export (default: in the temp folder)")
    ap.add_argument("--from-state", action="store_true", help="skip training: export and evaluate --state")
    ap.add_argument("--eval", type=int, default=30, help="held-out tool tasks to evaluate at the end (default: 30)")
    args = ap.parse_args(argv)
    import optax
    from tqdm import tqdm

    if args.from_state:
        master, tok, cfg = load_state(args.state)
        return finish(args, cfg, model_params(master, cfg), tok)
    t_start = time.perf_counter()
    # Enough conversations for every step, with some slack for the bucket remainders and dropped samples.
    need = int(args.steps * args.batch * 1.1) + 8 * args.batch
    samples = list(itertools.islice(C.samples(args.seed, "train"), need))
    tok = C.train_tokenizer([s.text for s in samples[:4000]], VOCAB)
    data = Batches(tok, samples, args.batch, args.seed)
    if len(data.batches) < args.steps:
        raise SystemExit(f"only {len(data.batches)} batches for {args.steps} steps")
    cfg = demo_config(tok.vocab_size, tok.stop_token_ids, tok.pad_token_id, args.layers, args.hidden)
    print(f"corpus: {len(samples)} conversations ({data.dropped} too long, dropped), tokenizer: {tok.vocab_size} "
          f"ids, tool prefix: {len(data.prefix[TOOLS])} tokens; setup {time.perf_counter() - t_start:.1f} s",
          file=sys.stderr)

    master = init_master(cfg, jax.random.key(args.seed))
    kind, toks, _ = next(b for b in data.batches if b[0] == TOOLS)
    check_train_forward(cfg, model_params(master, cfg), data.prefix[kind], toks)

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup_steps=max(1, args.steps // 20),
                                                  decay_steps=args.steps, end_value=args.lr * 0.05)
    decay_mask = jax.tree.map(lambda x: x.ndim >= 2, master)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=0.01, mask=decay_mask))
    opt_state = optimizer.init(master)
    step = make_step(cfg, optimizer)
    prefixes = {k: jnp.asarray(v) for k, v in data.prefix.items()}

    t_train, cpu_train = time.perf_counter(), time.process_time()
    bar = tqdm(data.batches[:args.steps], desc="train", unit="step", file=sys.stderr, mininterval=2.0)
    smooth = None
    for kind, toks, mask in bar:
        master, opt_state, loss = step(master, opt_state, prefixes[kind], jnp.asarray(toks), jnp.asarray(mask))
        loss = float(loss)
        smooth = loss if smooth is None else 0.95 * smooth + 0.05 * loss
        bar.set_postfix(loss=f"{smooth:.3f}", refresh=False)
    train_s, cpu_s = time.perf_counter() - t_train, time.process_time() - cpu_train
    # CPU seconds say what the run costs on a shared machine (wall time depends on who else is running).
    print(f"trained {args.steps} steps x {args.batch} conversations in {train_s:.0f} s wall, {cpu_s:.0f} CPU-s "
          f"(compiles included; total {time.perf_counter() - t_start:.0f} s wall, {time.process_time():.0f} CPU-s); "
          f"final loss {smooth:.4f}", file=sys.stderr)

    save_state(args.state, master, tok, cfg)
    return finish(args, cfg, model_params(master, cfg), tok)


def save_state(path: str, master: Params, tok, cfg: FlintConfig) -> None:
    """The FP32 master weights, tokenizer and config, so export can be redone without training (--from-state)."""
    leaves = {str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(master))}
    np.savez(path, tokenizer=np.asarray(tok.to_json_str()), config=np.asarray(json.dumps(cfg.to_hf())), **leaves)
    print(f"saved training state to {path}", file=sys.stderr)


def load_state(path: str):
    from flint_jax.chat import FlintTokenizer
    with np.load(path) as z:
        tok = FlintTokenizer.from_tokenizer_json(str(z["tokenizer"]))
        cfg = FlintConfig.from_hf(json.loads(str(z["config"])))
        treedef = jax.tree.structure(init_master(cfg, jax.random.key(0)))
        master = jax.tree.unflatten(treedef, [jnp.asarray(z[str(i)]) for i in range(treedef.num_leaves)])
    return master, tok, cfg


def finish(args, cfg: FlintConfig, params: Params, tok) -> int:
    if args.no_export:
        evaluate(cfg, params, tok, args.eval, "BF16 (in memory)", args.seed)
        return 0
    os.makedirs(args.out, exist_ok=True)
    paths = export(cfg, params, tok, args.out)
    if args.eval:
        from flint_jax.chat import FlintTokenizer
        from flint_jax.convert.load import load
        loaded = {fmt: load(path) for fmt, path in paths.items()}
        tok = FlintTokenizer.from_gguf_metadata(loaded["nvfp4"].tokenizer_metadata)
        held = list(itertools.islice(C.samples(args.seed + 1, "held_out"), 32))
        ppl = {fmt: C.assistant_perplexity(m.params, m.cfg, tok, held) for fmt, m in loaded.items()}
        print(f"held-out assistant perplexity: NVFP4 {ppl['nvfp4']:.4f}, BF16 {ppl['bf16']:.4f} "
              f"(ratio {ppl['nvfp4'] / ppl['bf16']:.4f})", file=sys.stderr)
        evaluate(loaded["nvfp4"].cfg, loaded["nvfp4"].params, tok, args.eval, "NVFP4 GGUF", args.seed)
    return 0


def evaluate(cfg: FlintConfig, params: Params, tok, n: int, what: str, seed: int) -> dict:
    from flint_jax.engine import Engine
    t0 = time.perf_counter()
    engine = Engine(cfg, params, max_batch=8, max_len=768, chunk_size=128, tokenizer=tok)
    res = C.evaluate_tool_use(engine, tok, C.held_out_cases(n, seed=2024 + seed))
    print(f"{what}: {n} held-out tool tasks: tool call {res['tool_call_accuracy']:.1%}, answer "
          f"{res['answer_accuracy']:.1%}, both {res['end_to_end_accuracy']:.1%} ({time.perf_counter() - t0:.0f} s)",
          file=sys.stderr)
    for r in res["cases"]:
        if not (r["call_ok"] and r["answer_ok"]):
            print(f"  miss: {r['question']!r} -> {r['turn1']!r} / {r['turn2']!r}", file=sys.stderr)
    return res


def export(cfg: FlintConfig, params: Params, tok, out: str) -> dict[str, str]:
    """GGUF NVFP4 (the project quantizer) and GGUF BF16, with the tokenizer and chat template in the metadata."""
    from flint_jax.convert.gguf_writer import write_gguf
    meta = tok.to_gguf_metadata(pad_to=cfg.vocab_size)
    paths = {}
    for fmt in ("nvfp4", "bf16"):
        path = os.path.join(out, f"{DEMO_FILE_STEM}-{fmt}.gguf")
        write_gguf(path, cfg, params, weights=fmt, tokenizer_metadata=meta, name=f"{C.DEMO_NAME} {fmt.upper()}")
        print(f"wrote {path} ({os.path.getsize(path) / 1e6:.2f} MB)", file=sys.stderr)
        paths[fmt] = path
    with open(os.path.join(out, "demo_tools.json"), "w", encoding="utf-8") as f:
        json.dump(C.DEMO_TOOLS, f, indent=1)
        f.write("\n")
    return paths


if __name__ == "__main__":
    sys.exit(main())
