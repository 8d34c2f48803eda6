import subprocess
import sys


def flint(*args):
    return subprocess.run([sys.executable, "-m", "flint_jax.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_help_and_usage_errors():
    r = flint("--help")
    assert r.returncode == 0 and "generate" in r.stdout and "chat" in r.stdout
    assert flint().returncode == 2
    assert flint("generate", "--max-tokens", "x").returncode == 2
    r = flint("generate", "--steps-per-dispatch", "0")
    assert r.returncode == 2 and "expected an integer >= 1, got '0'" in r.stderr
    r = flint("generate", "--kv-dtype", "fp16")
    assert r.returncode == 2 and "--kv-dtype: invalid choice: 'fp16'" in r.stderr
    r = flint("generate", "--steps-per-dispatch", "auto")
    assert r.returncode == 2 and "expected an integer >= 1, got 'auto'" in r.stderr


def test_generate_runs_and_bad_values_exit_1():
    r = flint("generate", "--prompt", "Hi", "--max-tokens", "3", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hi") and "model:" in r.stderr and "3 tokens" in r.stderr
    r = flint("generate", "--top-p", "0")
    assert r.returncode == 1 and "top_p" in r.stderr
    r = flint("generate", "--prefill-chunk", "0")
    assert r.returncode == 1 and "chunk_size must be >= 1" in r.stderr


def test_generate_prefill_chunk_does_not_change_the_tokens():
    args = ("generate", "--prompt", "The quick brown fox jumps over the lazy dog", "--max-tokens", "4",
            "--temperature", "0")
    whole, chunked = flint(*args), flint(*args, "--prefill-chunk", "3")
    assert whole.returncode == 0 and chunked.returncode == 0, whole.stderr + chunked.stderr
    assert whole.stdout == chunked.stdout


def test_generate_pallas_path_gives_the_reference_tokens():
    """`--impl pallas` (the fused decode kernels, in interpret mode on the CPU) on the default model: the same greedy
    tokens as the XLA reference."""
    args = ("generate", "--prompt", "What is 2 + 2?", "--chat", "--max-tokens", "6", "--temperature", "0")
    ref, fused = flint(*args), flint(*args, "--impl", "pallas")
    assert ref.returncode == 0 and fused.returncode == 0, ref.stderr + fused.stderr
    assert "6 tokens" in ref.stderr and ref.stdout == fused.stdout


def test_chat_one_shot_with_the_default_model_shows_the_tool_call():
    r = flint("chat", "--message", "How many miles is 43 kilometers?", "--temperature", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert "[thinking]" in r.stdout and "[tool call] convert_units(" in r.stdout
    assert '"finish_reason": "tool_calls"' in r.stdout


def test_chat_bad_tools_file_exits_1(tmp_path):
    bad = tmp_path / "tools.json"
    bad.write_text("{not json")
    r = flint("chat", "--message", "hi", "--tools", str(bad))
    assert r.returncode == 1 and "tools.json: not valid JSON" in r.stderr


def test_impl_defaults_to_pallas_only_on_a_gpu(monkeypatch):
    """Without --impl the CLI runs the fused kernels where they compile (a GPU) and the reference elsewhere; an
    explicit --impl always wins."""
    import argparse

    import jax

    from flint_jax.cli import resolve_impl
    for backend, expected in (("gpu", "pallas"), ("cpu", "xla")):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert resolve_impl(argparse.Namespace(impl=None)) == expected
        assert resolve_impl(argparse.Namespace(impl="xla")) == "xla"
        assert resolve_impl(argparse.Namespace(impl="pallas")) == "pallas"
