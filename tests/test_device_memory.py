"""device_memory: the up-front check that a model and its state fit the device, and the scripts that skip with it."""
import json
import os
import subprocess
import sys

import jax
import pytest

from flint_jax import device_memory as DM
from flint_jax.config import FlintConfig
from flint_jax.layer_stack import MAX_CHUNK_BYTES
from flint_jax.params import init_params, weight_bytes_total
from flint_jax.state import state_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100_POOL = int(0.92 * 85.0e9)  # an H100 80GB (79.2 GiB) at the benchmarks' XLA_PYTHON_CLIENT_MEM_FRACTION


@pytest.mark.parametrize("weights", ["nvfp4", "bf16"])
def test_weight_bytes_total_is_what_init_params_allocates(weights):
    cfg = FlintConfig.tiny()
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), weights))
    assert weight_bytes_total(cfg, weights) == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def test_flint_in_bf16_does_not_fit_an_h100_and_says_why():
    cfg = FlintConfig.flint()
    why = DM.model_shortfall(cfg, "bf16", stacking=True, limit=H100_POOL)
    assert why is not None
    assert "bf16 weights (79.4 GB) + one stacking chunk (2.1 GB) need 81.6 GB" in why
    assert "78.2 GB" in why and jax.devices()[0].device_kind in why
    assert DM.model_shortfall(cfg, "nvfp4", stacking=True, limit=H100_POOL) is None
    assert DM.model_shortfall(cfg, "bf16", stacking=True, limit=int(0.92 * 150.0e9)) is None  # an H200 (141 GB)


def test_the_kv_state_counts():
    cfg = FlintConfig.flint()
    kv = state_bytes(cfg, 8, 262_152)
    assert kv > 50e9  # batch 8 at 262K: ~60 GB of BF16 full caches
    need = weight_bytes_total(cfg, "nvfp4") + kv
    assert DM.model_shortfall(cfg, "nvfp4", batch=8, max_len=262_152, limit=need) is None
    why = DM.model_shortfall(cfg, "nvfp4", batch=8, max_len=262_152, limit=need - 1)
    assert "the KV state of 8 x 262152 tokens" in why
    # FP8 full caches take about half
    assert DM.model_shortfall(cfg, "nvfp4", batch=8, max_len=262_152, kv_dtype="fp8", limit=need // 2 + 13e9) is None


def test_stacking_headroom_is_one_chunk_at_most():
    cfg = FlintConfig.tiny()
    w = weight_bytes_total(cfg, "nvfp4")
    assert w < MAX_CHUNK_BYTES  # the tiny model: the chunk is the whole model
    assert DM.model_shortfall(cfg, "nvfp4", stacking=True, limit=2 * w) is None
    assert DM.model_shortfall(cfg, "nvfp4", stacking=True, limit=2 * w - 1) is not None


def test_memory_limit_on_the_cpu_comes_from_the_environment_only(monkeypatch):
    monkeypatch.delenv(DM.LIMIT_ENV, raising=False)
    assert DM.memory_limit() is None  # the CPU backend reports no allocator limit
    assert DM.shortfall(10**15, "anything") is None
    monkeypatch.setenv(DM.LIMIT_ENV, "1.5")
    assert DM.memory_limit() == 1_500_000_000
    assert "anything need 2.0 GB, more than the 1.5 GB" in DM.shortfall(2 * 10**9, "anything")
    monkeypatch.setenv(DM.LIMIT_ENV, "lots")
    with pytest.raises(ValueError, match="FLINT_MEMORY_LIMIT_GB must be a number of GB, not 'lots'"):
        DM.memory_limit()


def test_bench_decode_skips_weights_that_do_not_fit(tmp_path):
    """The tiny model under a limit between its NVFP4 and BF16 sizes: NVFP4 runs, BF16 is skipped and reported."""
    cfg = FlintConfig.tiny()
    nv, bf = weight_bytes_total(cfg, "nvfp4"), weight_bytes_total(cfg, "bf16")
    limit = 2 * nv + state_bytes(cfg, 1, cfg.max_position_embeddings)  # stacking doubles at most; BF16: 2 x bf > it
    assert 2 * bf > limit
    env = {**os.environ, DM.LIMIT_ENV: str(limit / 1e9)}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_decode.py"), "--tiny", "--out",
                        str(tmp_path), "--weights", "bf16,nvfp4", "--impls", "pallas:stacked", "--batches", "1",
                        "--served-steps", "0"], capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "bf16: skipped: bf16 weights" in p.stdout + p.stderr
    res = json.loads((tmp_path / "results.json").read_text())
    assert {pt["weights"] for pt in res["points"]} == {"nvfp4"}
    assert [s["weights"] for s in res["skipped"]] == ["bf16"] and "one stacking chunk" in res["skipped"][0]["reason"]
    assert "Skipped (weights bf16): bf16 weights" in (tmp_path / "results.md").read_text()


def test_profile_decode_and_bench_engine_say_what_does_not_fit(tmp_path):
    env = {**os.environ, DM.LIMIT_ENV: "0.0001"}  # 100 KB: not even the tiny model
    run = [sys.executable, os.path.join(ROOT, "scripts", "profile_decode.py"), "--tiny", "--out", str(tmp_path),
           "--impls", "xla", "--steps", "2"]
    p = subprocess.run(run, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["runs"] == [] and report["skipped"][0]["weights"] == "nvfp4"
    assert "## nvfp4: skipped" in (tmp_path / "profile.md").read_text()
    run = [sys.executable, os.path.join(ROOT, "scripts", "bench_engine.py"), "--tiny", "--out", str(tmp_path)]
    p = subprocess.run(run, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert p.returncode == 1 and "bench_engine: nvfp4 weights" in p.stderr and "one stacking chunk" in p.stderr
