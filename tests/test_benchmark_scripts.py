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
    run_script("bench_decode.py", "--tiny", "--out", str(tmp_path), "--weights", "nvfp4", "--impls", "xla,pallas",
               "--batches", "1")
    res = json.loads((tmp_path / "results.json").read_text())
    impls = {p["impl"] for p in res["points"]}
    assert impls == {"xla", "pallas"}
    for p in res["points"]:
        assert p["forward_ms"] > 0 and p["forward_wall_ms"] > 0 and p["bytes"] > 0 and p["kernels"] > 0
        assert p["forward_device_ms"] is None  # no GPU: no device events, the headline falls back to wall time
    assert any("served_ms" in p for p in res["points"])
    burst = [p for p in res["points"] if "served_steps" in p]
    assert len(burst) == 1 and burst[0]["impl"] == "pallas" and burst[0]["served_burst_wall_ms_per_token"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "| nvfp4 | pallas | 1 |" in table and "| nvfp4 | xla | 1 |" in table
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


def test_dispatch_overhead_runs():
    out = run_script("dispatch_overhead.py", "--iters", "2")
    assert "nvfp4: " in out and "bf16: " in out and "parameter buffers" in out


def test_tune_weight_kernels_tiny(tmp_path):
    run_script("tune_weight_kernels.py", "--tiny", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "tune.json").read_text())["rows"]
    assert {r["case"] for r in rows} == {"qkv", "o", "gate_up", "down", "router"}
    assert all(r.get("ran") for r in rows), [r for r in rows if not r.get("ran")]
    assert sum(r["block"] == "table" for r in rows) == 5  # the table's choice and one grid setting per kernel
