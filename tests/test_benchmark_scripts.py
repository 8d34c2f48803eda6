"""The GPU benchmark scripts' CPU smoke modes (`--tiny`): the same code paths on FlintConfig.tiny(), so a change that
breaks a script fails CI instead of a device run."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name, *args, timeout=900):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr


def test_bench_decode_tiny(tmp_path):
    run_script("bench_decode.py", "--tiny", "--out", str(tmp_path), "--weights", "nvfp4", "--impls",
               "xla,pallas:stacked", "--batches", "1")
    res = json.loads((tmp_path / "results.json").read_text())
    layouts = {p["impl"]: p["layout"] for p in res["points"]}
    assert layouts == {"xla": "layers", "pallas": "stacked"}
    buffers = {p["impl"]: p["argument_buffers"] for p in res["points"]}
    assert buffers["pallas"] < buffers["xla"] / 2
    for p in res["points"]:
        assert p["forward_ms"] > 0 and p["forward_wall_ms"] > 0 and p["bytes"] > 0 and p["kernels"] > 0
        assert p["forward_device_ms"] is None  # no GPU: no device events, the headline falls back to wall time
    assert any("served_ms" in p for p in res["points"])
    burst = [p for p in res["points"] if "served_steps" in p]
    assert len(burst) == 1 and burst[0]["impl"] == "pallas" and burst[0]["served_burst_wall_ms_per_token"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "| nvfp4 | pallas | stacked |" in table and "| nvfp4 | xla | layers |" in table
    # the vLLM-shaped summary: initial (xla) and optimized (pallas) columns filled from the measured points
    row = next(line for line in table.splitlines() if line.startswith("| nvfp4 | decode forward ms |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "1.78" and cells[3] != "-" and cells[4] != "-"


def test_profile_decode_tiny(tmp_path):
    out = run_script("profile_decode.py", "--tiny", "--out", str(tmp_path), "--impls", "xla", "--steps", "2")
    assert "no device events" in out
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["runs"][0]["impl"] == "xla" and report["runs"][0]["device_ms"] is None
    assert "## nvfp4/xla" in (tmp_path / "profile.md").read_text()


def test_profile_decode_rejects_unknown_variant(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "profile_decode.py"), "--tiny", "--out",
                        str(tmp_path), "--variants", "nonsense"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode != 0 and "unknown variant 'nonsense'" in (p.stdout + p.stderr)


def test_profile_decode_variants_combine_with_plus():
    """"a+b" sets both variants' knobs inside the context and restores both after it; an unknown part is refused."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("profile_decode", os.path.join(ROOT, "scripts", "profile_decode.py"))
    pd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pd)
    from flint_jax.pallas_kernels import decode_attention as DA
    before = (DA.ROPE_TABLE, DA.RING_SPLITS)
    with pd.variant("rope_in_kernel+ring_splits16"):
        assert (DA.ROPE_TABLE, DA.RING_SPLITS) == (False, 16)
    assert (DA.ROPE_TABLE, DA.RING_SPLITS) == before
    try:
        pd.variant("rope_in_kernel+nonsense")
    except SystemExit as e:
        assert "unknown variant 'nonsense'" in str(e)
    else:
        raise AssertionError("an unknown part was accepted")


def test_bench_engine_tiny(tmp_path):
    """Engine.generate per variant; overlap_dispatch, the burst length and stacked parameters leave the tokens
    unchanged on the CPU, and stacking cuts the buffers handed over per call."""
    out = run_script("bench_engine.py", "--tiny", "--out", str(tmp_path), "--variants",
                     "3:on:stacked,1:off,1:on:stacked_caches", "--repeats", "1")
    rows = json.loads((tmp_path / "engine.json").read_text())["rows"]
    assert [(r["steps_per_dispatch"], r["overlap_dispatch"], r["layout"]) for r in rows] == [
        (1, False, "layers"), (3, True, "stacked"), (1, True, "stacked_caches")]  # per-layer variants first
    assert all(r["decode_ms_per_token"] > 0 and r["same_tokens_as_first"] for r in rows)
    assert rows[2]["argument_buffers"] < rows[1]["argument_buffers"] < rows[0]["argument_buffers"] / 2
    assert "| 3 | on | stacked |" in out


def test_bench_engine_trace_on_the_cpu_reports_no_device_trace(tmp_path):
    """--trace runs one more generate under the profiler; on the CPU the trace has no kernels, which is said, not
    an error (the tables themselves are device_trace.marker_periods', tested in test_device_trace.py)."""
    out = run_script("bench_engine.py", "--tiny", "--out", str(tmp_path), "--variants", "1:on:stacked_caches",
                     "--repeats", "1", "--new-tokens", "4", "--trace")
    rows = json.loads((tmp_path / "engine.json").read_text())["rows"]
    assert rows[0]["trace"] == {"periods": 0} and len(rows[0]["tokens"]) == 4
    assert "| 1 | on | stacked_caches |" in out


def test_bench_engine_rejects_bad_variant(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_engine.py"), "--tiny", "--out",
                        str(tmp_path), "--variants", "4:maybe"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode != 0 and "bad variant '4:maybe'" in (p.stdout + p.stderr)


def test_kernel_sass_writes_the_triton_ir(tmp_path):
    """The offline code inspection's first half (no Triton needed): the kernel's Triton IR from a CUDA lowering."""
    out = run_script("kernel_sass.py", "--out", str(tmp_path), "--n", "256", "--k", "512", "--rows", "8",
                     "--block", "32,256,2,3,1", "--ttir-only")
    ttir = (tmp_path / "linear_nvfp4_256x512_m8_b32-256-2-3-1.ttir").read_text()
    assert "tt.func" in ttir and "tt.dot" in ttir and "dot=True" in out  # the tensor-core path, as asked
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "kernel_sass.py"), "--out", str(tmp_path),
                        "--n", "256", "--k", "512", "--block", "32,256"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert p.returncode != 0 and "--block wants bn,bk,warps,stages[,dot]" in (p.stdout + p.stderr)


def test_kernel_sass_lists_the_moe_blocks_kernels(tmp_path):
    """--moe: every Triton kernel of Flint's MoE block (three kernels; with PERSISTENT one, whose IR holds the grid
    barriers: atomic arrivals and a polling loop)."""
    out = run_script("kernel_sass.py", "--out", str(tmp_path), "--moe", "three", "--ttir-only")
    assert out.count("Triton IR ->") == 3
    assert all(f"{name}: " in out for name in ("router_logits", "moe_gate_up_nvfp4", "moe_down_nvfp4"))
    out = run_script("kernel_sass.py", "--out", str(tmp_path), "--moe", "persistent", "--ttir-only")
    assert out.count("Triton IR ->") == 1 and "moe_persistent_nvfp4: 4 warps" in out
    ttir = next(tmp_path.glob("moe_persistent_nvfp4_m1_0_*.ttir")).read_text()
    assert "tt.atomic_rmw" in ttir and "scf.while" in ttir
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "kernel_sass.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode != 0 and "--n and --k are required" in (p.stdout + p.stderr)


def test_kernel_sass_lists_a_full_layers_attention_kernels(tmp_path):
    """--attention: the four Triton kernels of a full layer's decode attention block at the Flint shape. On an FP8
    cache with the defaults (V key-major) the 8 query heads pad to 16 rows on the dots' M dimension: scores = q K^T
    per half head and o = p V on FP16 operands over 128-key blocks. With V stored transposed the keys sit on M and the
    heads on N: scores^T = K q^T, o^T = V^T p^T; with the heads on M instead, V^T comes transposed; EP's kernel ran
    the values dot in FP32 over 64 keys."""
    out = run_script("kernel_sass.py", "--out", str(tmp_path), "--attention", "fp8", "--ttir-only")
    assert out.count("Triton IR ->") == 4
    assert all(f"{name}: " in out for name in ("qkv_projection", "decode_attention_fused_full",
                                                 "decode_attention_combine", "linear_nvfp4"))
    ttir = next(tmp_path.glob("attention_fp8_nvfp4_m1_1_*.ttir")).read_text()
    assert ttir.count("tensor<16x64xf16> * tensor<64x128xf16>") == 2
    assert "tensor<16x128xf16> * tensor<128x128xf16>" in ttir and "x8xf16>" not in ttir
    run_script("kernel_sass.py", "--out", str(tmp_path), "--attention", "fp8_v_transposed", "--ttir-only")
    ttir = next(tmp_path.glob("attention_fp8_v_transposed_nvfp4_m1_1_*.ttir")).read_text()
    assert ttir.count("tensor<128x64xf16> * tensor<64x8xf16>") == 2
    assert "tensor<128x128xf16> * tensor<128x8xf16>" in ttir and "tensor<16x" not in ttir
    run_script("kernel_sass.py", "--out", str(tmp_path), "--attention", "fp8_heads_on_m", "--ttir-only")
    ttir = next(tmp_path.glob("attention_fp8_heads_on_m_nvfp4_m1_1_*.ttir")).read_text()
    assert "tensor<16x128xf16> * tensor<128x128xf16>" in ttir and "tensor<128x8x" not in ttir
    run_script("kernel_sass.py", "--out", str(tmp_path), "--attention", "fp8_as_ep", "--ttir-only")
    ttir = next(tmp_path.glob("attention_fp8_as_ep_nvfp4_m1_1_*.ttir")).read_text()
    assert "tensor<16x64xf32> * tensor<64x128xf32>" in ttir and "xf16>" not in ttir
    out = run_script("kernel_sass.py", "--out", str(tmp_path), "--attention", "fp8_w2", "--ttir-only")
    assert "decode_attention_fused_full: 2 warps, 3 stages" in out  # the sweep's 2-warp point: 64-key FP16 blocks
    ttir = next(tmp_path.glob("attention_fp8_w2_nvfp4_m1_1_*.ttir")).read_text()
    assert ttir.count("tensor<16x64xf16> * tensor<64x64xf16>") == 2  # scores per half head over 64 keys
    assert ttir.count("tensor<16x64xf16> * tensor<64x128xf16>") == 1 and "tensor<16x128xf16>" not in ttir


def test_kernel_sass_finds_the_longest_loop_body():
    """largest_loop (the per-block counts docs/KERNELS.md quotes): the longer of two loops, from its label to the
    last branch back to it, full opcodes with modifiers, predicates dropped; a forward branch is no loop."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        from kernel_sass import largest_loop
    finally:
        sys.path.pop(0)
    sass = "\n".join(["Function:k", "--:-:1:-:1\tLDC R1, c[0x0][0x28];", "LBB0:",
                      "--:-:-:-:1\tFADD R2, R2, R3;", "--:-:-:-:1\t@P0 BRA LBB0;", "LBB1:",
                      "--:-:-:-:1\tLDS.U8 R4, [R5];", "--:-:-:-:1\tLDS.U8 R6, [R5+0x1];",
                      "--:-:-:-:1\t@!P1 BRA LBB2;", "--:-:-:-:1\tHMMA.16816.F32 R8, R10, R12, R8;",
                      "--:-:-:-:1\t@P1 BRA LBB1;", "LBB2:", "--:-:-:-:1\tEXIT;"])
    assert largest_loop(sass) == ["LDS.U8", "LDS.U8", "BRA", "HMMA.16816.F32", "BRA"]
    assert largest_loop("Function:k\n--:-:-:-:1\tEXIT;") == []


def test_dispatch_overhead_runs():
    out = run_script("dispatch_overhead.py", "--iters", "2")
    assert "nvfp4: " in out and "bf16: " in out and "parameter buffers" in out


def test_tune_weight_kernels_tiny(tmp_path):
    run_script("tune_weight_kernels.py", "--tiny", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "tune.json").read_text())["rows"]
    assert {r["case"] for r in rows} == {"qkv", "o", "gate_up", "down", "router"}
    assert all(r.get("ran") for r in rows), [r for r in rows if not r.get("ran")]
    assert sum(r["block"] == "table" for r in rows) == 5  # the table's choice and one grid setting per kernel


def test_bench_prefill_tiny(tmp_path):
    """The prefill benchmark's CPU smoke mode: kernel checks, the engine-path prefill (kept and fresh state), the
    per-layer loop, the TTFT on the engine path, the engine's prefill compiled without command buffers and as the
    one program it was before prefill_pipeline, and the synthetic
    model's routing balance with the grouped GEMMs timed at it."""
    run_script("bench_prefill.py", "--tiny", "--check", "--out", str(tmp_path), "--weights", "nvfp4",
               "--skip", "moe,attn,jax,extras", "--no-sweep", "--program-variants",
               "default,no_command_buffers,one_program")
    res = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert res["check"] and all(v["ok"] for v in res["check"].values())
    assert "grouped_swiglu, rows gathered by index nvfp4" in res["check"]
    assert res["check_router"]["ok"] and res["check_router"]["rows_with_other_experts"] == 0.0
    prog = res["prefill"]["nvfp4"]["program, one chunk of 32"]
    assert prog["ms"] > 0 and prog["fresh_state_ms"] > 0
    assert len(prog["returns_after_ms"]) == 3 and all(
        0 < b <= d for b, d in zip(prog["returns_after_ms"], prog["done_after_ms"]))
    assert res["prefill"]["nvfp4"]["program, one chunk of 32, no_command_buffers"]["ms"] > 0
    assert res["prefill"]["nvfp4"]["program, one chunk of 32, one_program"]["ms"] > 0
    assert res["prefill"]["nvfp4"]["kernels, one chunk of 32, per-layer calls"]["ms"] > 0
    rb = res["routing"]["nvfp4"]
    assert len(rb["layers"]) == 3 and rb["pairs"] == 32 * 2  # the tiny config's MoE layers, tokens x top-k
    for layer in rb["layers"].values():
        assert sum(layer["counts"]) == rb["pairs"] and max(layer["counts"]) == layer["max"]
        assert layer["visits_64"] == sum(-(-c // 64) for c in layer["counts"])
    timed = res["moe"][f"nvfp4, routing of the model's layer {rb['median_layer']}"]
    assert any(k.startswith("ours swiglu") and v["ms"] > 0 for k, v in timed.items())
    ttft = res["ttft"]["nvfp4"]
    assert ttft["program_ttft_s"] > 0 and len(ttft["program_per_chunk"]) == ttft["n_chunks"]
    assert "the engine's path" in (tmp_path / "bench_prefill.md").read_text()


def test_bench_prefill_tiny_ttft_on_fp8_caches(tmp_path):
    """--kv-dtype fp8: the TTFT run on the engine's path fills FP8 full caches and gives the
    first token; the report names the cache type."""
    run_script("bench_prefill.py", "--tiny", "--out", str(tmp_path), "--weights", "nvfp4", "--kv-dtype", "fp8",
               "--skip", "moe,attn,jax,extras,prefill,routing", "--no-sweep")
    res = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert res["meta"]["kv_dtype"] == "fp8" and not res.get("errors")
    ttft = res["ttft"]["nvfp4"]
    assert ttft["program_ttft_s"] > 0 and len(ttft["program_per_chunk"]) == ttft["n_chunks"]
    assert "full-layer KV caches fp8" in (tmp_path / "bench_prefill.md").read_text()


def test_bench_prefill_tiny_kernel_sections(tmp_path):
    """The one-layer MoE and attention sections on the CPU: every timed row has a wall time and, where the backend
    has device events (not here), a device time; the Markdown report has both columns."""
    run_script("bench_prefill.py", "--tiny", "--out", str(tmp_path), "--weights", "nvfp4",
               "--skip", "prefill,ttft,extras,jax", "--no-sweep")
    res = json.loads((tmp_path / "bench_prefill.json").read_text())
    ours = [k for k in res["attn"] if not k.startswith("reference")]
    assert {k.split()[0] for k in ours} == {"ring", "full"}
    assert all(res["attn"][k]["ms"] > 0 and "device_ms" not in res["attn"][k] for k in ours)
    assert any(k.startswith("ours swiglu") for k in res["moe"]["nvfp4"])
    assert "| device ms |" in (tmp_path / "bench_prefill.md").read_text()


def test_mosaic_gpu_probes_lower_for_cuda(tmp_path):
    """The Mosaic GPU probes lower for CUDA on the CPU (their kernels run only on the device machine): the PDL
    variants carry the launch attribute, the others do not, and only the `_attr` variants put `uses_pdl` in the
    custom call's backend config (for XLA's programmatic graph edges); the persistent variants are one kernel."""
    run_script("probe_pdl.py", "--out", str(tmp_path / "pdl"), "--lower-only", "--layers", "2")
    pdl = json.loads((tmp_path / "pdl" / "probe_pdl.json").read_text())["variants"]
    assert pdl["mosaic"]["mosaic_calls"] > 0 and pdl["mosaic"]["uses_pdl"] == 0
    assert pdl["mosaic_pdl"]["uses_pdl"] == 2 and pdl["triton"]["mosaic_calls"] == 0
    assert pdl["mosaic_pdl"]["uses_pdl_config"] == 0 and pdl["mosaic_pdl_attr"]["uses_pdl_config"] == 2
    assert pdl["mosaic"]["kernels"] == 2  # one kernel per layer
    assert all(pdl[v]["kernels"] == 1 for v in pdl if v.startswith(("persistent", "barrier_only")))  # one chain
    assert all(pdl[v]["gpu_scope_signal"] == ("_gpu" in v) for v in pdl)  # the signal each variant names
    run_script("probe_mosaic_gemv.py", "--out", str(tmp_path / "gemv"), "--lower-only", "--shapes", "o_proj",
               "--splits", "2", "--weights", "bf16,nvfp4")
    gemv = json.loads((tmp_path / "gemv" / "probe_mosaic_gemv.json").read_text())
    assert gemv["shapes"]["o_proj bf16"]["mosaic_s2"]["lowered_chars"] > 0
    assert gemv["shapes"]["o_proj nvfp4"]["mosaic_s2"]["lowered_chars"] > 0


def test_bench_kernels_attention_smoke(tmp_path):
    """The attention benchmark's CPU smoke mode: every decode-attention and attention-block case on tiny shapes in
    interpret mode, each within its tolerance of the XLA reference; no device events, so no device time."""
    run_script("bench_kernels_attention.py", "--smoke", "--quick", "--skip-tests", "--sections", "attn,block,fp8sweep",
               "--out", str(tmp_path))
    res = json.loads((tmp_path / "attention_bench.json").read_text())
    assert res["errors"] == []
    checked = [r for r in res["rows"] if "rel_err" in r]
    assert len(checked) >= 11  # 5 decode-attention contexts/batches, 4 attention blocks, 2 FP8 sweep points
    fp8 = [r for r in checked if r.get("kv_dtype") == "float8_e4m3fn"]
    assert len(fp8) == 2 and "warps=2" in fp8[1]["kernel"]
    assert all(r["rel_err"] < 1e-2 for r in checked)
    assert all("device_us" not in r for r in res["rows"])


def test_check_layer_stack_tiny():
    """The full-shape layout check's CPU smoke run: stacked and per-layer parameters agree bit for bit there."""
    out = run_script("check_layer_stack.py", "--tiny")
    assert "prefill (last token): bit-identical True" in out and "decode: bit-identical True" in out


def test_mosaic_nvfp4_probes_lower_for_cuda(tmp_path):
    """The hand-written NVFP4 decode kernels lower for CUDA on the CPU: the GEMV with x as written, a residual and a
    persistent grid; the MoE gate/up with its in-kernel top-k (the layouts and arithmetic are emulated in
    tests/test_mosaic_*_probe.py)."""
    run_script("probe_mosaic_nvfp4.py", "--out", str(tmp_path / "nv"), "--lower-only", "--shapes", "o_proj",
               "--variants", "q8_st4_ov_nat_res_p128,q4_st4_nat")
    nv = json.loads((tmp_path / "nv" / "probe_mosaic_nvfp4.json").read_text())["shapes"]["o_proj"]
    assert nv["q8_st4_ov_nat_res_p128"]["lowered_chars"] > 0
    assert "q >= 8" in nv["q4_st4_nat"]["error"]
    run_script("probe_mosaic_moe.py", "--out", str(tmp_path / "moe"), "--lower-only", "--variants", "q8_st4_nat_rt")
    moe = json.loads((tmp_path / "moe" / "probe_mosaic_moe.json").read_text())
    assert moe["experts"] == 256 and moe["variants"]["q8_st4_nat_rt"]["lowered_chars"] > 0


def test_probe_ring_smoke(tmp_path):
    """The ring probe's CPU mode: product variants give the same attention output (interpret mode: same bits), a
    diagnostic that drops RoPE does not, and an unknown variant is refused."""
    run_script("probe_ring.py", "--smoke", "--out", str(tmp_path), "--variants",
               "base,fold_in_kernel,rope_in_kernel,no_rope")
    rows = {r["variant"]: r for r in json.loads((tmp_path / "probe_ring.json").read_text())["rows"]}
    assert not any("error" in r for r in rows.values()), rows
    assert rows["base"]["o0_abs_mean"] == rows["fold_in_kernel"]["o0_abs_mean"] == rows["rope_in_kernel"]["o0_abs_mean"]
    assert rows["no_rope"]["o0_abs_mean"] != rows["base"]["o0_abs_mean"]
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "probe_ring.py"), "--smoke", "--out",
                        str(tmp_path), "--variants", "base,nope"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "unknown variants ['nope']" in p.stderr


def test_probe_kernel_floor_smoke(tmp_path):
    """The kernel-floor probe's CPU mode: each chain of kernels computes what it should (x + 1 per kernel)."""
    run_script("probe_kernel_floor.py", "--smoke", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "probe_kernel_floor.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["result_ok"] for r in rows)


def test_probe_lanes_tiny(tmp_path):
    """The lanes probe's CPU mode: two batch-1 lanes started from the rows of a batch-2 state compute the batch-2
    step's hidden states (other tile sums at most); an unknown variant is refused with exit status 2."""
    run_script("probe_lanes.py", "--tiny", "--out", str(tmp_path), "--variants", "b2,lanes2", "--steps", "2")
    rows = {r["variant"]: r for r in json.loads((tmp_path / "lanes.json").read_text())["runs"]}
    assert rows["b2"]["sequences"] == rows["lanes2"]["sequences"] == 2
    assert rows["lanes2"]["max_abs_diff_vs_batched"] <= 0.02 * rows["lanes2"]["batched_max_abs"]
    assert rows["lanes2"]["batched_max_abs"] > 0 and rows["lanes2"]["wall_ms"] > 0
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "probe_lanes.py"), "--tiny", "--out",
                        str(tmp_path), "--variants", "b2,lanes9"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "unknown variants ['lanes9']" in p.stderr


def test_ncu_decode_tiny():
    """The Nsight Compute driver runs the Pallas forward (tiny config, interpret mode) and marks where the profiled
    steps start; bad arguments are refused."""
    out = run_script("ncu_decode.py", "--tiny", "--steps", "1")
    assert "NCU_MARK steps start" in out and "ran 1 steps" in out
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "ncu_decode.py"), "--tiny", "--steps", "0"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 2 and "at least 1" in p.stderr


def test_ncu_table_summarises_a_raw_page(tmp_path):
    """ncu_table.py averages launches per kernel, converts units (ns -> us), lists the largest stall reasons, shows
    a missing metric as "-", sorts by duration, and refuses a file that is not an ncu raw page."""
    raw = tmp_path / "raw.csv"
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    raw.write_text(
        "==PROF== Connected to process\n"
        f'"ID","Kernel Name","launch__grid_size","gpu__time_duration.sum","{stall.format("long_scoreboard")}",'
        f'"{stall.format("barrier")}","{stall.format("wait")}"\n'
        '"","","","nsecond","ratio","ratio","ratio"\n'
        '"0","qkv_projection","320","6,000","12.0","3.0","0"\n'
        '"1","qkv_projection","320","7,000","14.0","1.0","0"\n'
        '"2","moe_gate_up_nvfp4","448","8,700","15.0","6.0","2.5"\n')
    out = run_script("ncu_table.py", str(raw))
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert rows[0].startswith("| `moe_gate_up_nvfp4` | 1 | 448 | - |")  # the longer kernel first; no block size
    cells = [c.strip() for c in rows[1].strip("|").split("|")]
    assert cells[:2] == ["`qkv_projection`", "2"] and cells[5] == "6.50"  # mean of 6.0 and 7.0 us
    assert cells[-1] == "long_scoreboard 13.0, barrier 2.0"  # a zero stall is left out
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "ncu_table.py"), str(bad)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode != 0 and "not an ncu raw CSV page" in p.stderr


def test_ncu_table_without_a_units_line(tmp_path):
    """A raw page without ncu's units line keeps its first launch (values then taken as they are)."""
    raw = tmp_path / "raw.csv"
    raw.write_text('"ID","Kernel Name","gpu__time_duration.sum"\n"0","router_logits","2.5"\n"1","router_logits","3.5"\n')
    rows = [line for line in run_script("ncu_table.py", str(raw)).splitlines() if line.startswith("| `")]
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[:2] == ["`router_logits`", "2"] and cells[5] == "3.00"


def test_ncu_table_takes_the_metric_names_of_newer_ncu(tmp_path):
    """ncu 2025.3 reports no dram__bytes_read.sum or dram__throughput: the DRAM megabytes come from its rate times
    the duration (1.5 Tbyte/s for 4 us is 6 MB), the DRAM % from gpu__dram_throughput, and the cycles between
    issues from smsp__average_warp_latency_per_inst_issued."""
    raw = tmp_path / "raw.csv"
    raw.write_text(
        '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes.sum.per_second",'
        '"gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed","smsp__average_warp_latency_per_inst_issued.ratio"\n'
        '"","","usecond","Tbyte/s","%","cycle"\n'
        '"0","linear_nvfp4","4.0","1.5","45.0","7.5"\n')
    lines = run_script("ncu_table.py", str(raw)).splitlines()
    header = next(line for line in lines if line.startswith("| kernel"))
    row = next(line for line in lines if line.startswith("| `"))
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")], [c.strip() for c in row.strip("|").split("|")]))
    assert cells["us"] == "4.00" and cells["DRAM MB"] == "6.00" and cells["DRAM %"] == "45.0"
    assert cells["cycles / issue"] == "7.50" and cells["SM %"] == "-"


def test_ncu_decode_sh_retries_a_crash_and_summarises(tmp_path):
    """ncu_decode.sh runs ncu once more when it crashes without a report (as on run FC's first try), then imports
    the report into the raw and details pages and the Markdown summary; a second crash fails the script."""
    fake = tmp_path / "ncu"
    calls = tmp_path / "calls"
    fake.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {calls}
if [ "$1" = --import ]; then
  case "$*" in *raw*) printf '"ID","Kernel Name","gpu__time_duration.sum"\\n"","","usecond"\\n"0","qkv_projection","6.5"\\n';;
               *) echo details;; esac
  exit 0
fi
if [ "$(grep -c export {calls})" -le "${{CRASHES:-1}}" ]; then exit 139; fi
while [ "$1" != --export ]; do shift; done
touch "$2.ncu-rep"
""")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, NCU=str(fake))
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "ncu_decode.sh"), str(out), "--tiny"], env=env,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "ncu exit 139 (attempt 1)" in p.stdout and "ncu exit 0 (attempt 2)" in p.stdout
    assert "| `qkv_projection` | 1 |" in (out / "ncu.md").read_text()
    assert (out / "ncu_details.csv").read_text() == "details\n"
    calls.unlink()
    out2 = tmp_path / "out2"
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "ncu_decode.sh"), str(out2), "--tiny"],
                       env=dict(env, CRASHES="2"), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 1 and "(attempt 2)" in p.stdout and not (out2 / "ncu.md").exists()
    # a report from an earlier run in the same folder is not taken for this one's
    calls.unlink()
    (out2 / "ncu.ncu-rep").write_text("stale")
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "ncu_decode.sh"), str(out2), "--tiny"],
                       env=dict(env, CRASHES="2"), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 1 and "(attempt 2)" in p.stdout and not (out2 / "ncu.md").exists()
