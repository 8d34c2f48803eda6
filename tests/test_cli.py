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


def test_generate_runs_and_bad_values_exit_1():
    r = flint("generate", "--prompt", "Hi", "--max-tokens", "3", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hi") and "model:" in r.stderr and "3 tokens" in r.stderr
    r = flint("generate", "--top-p", "0")
    assert r.returncode == 1 and "top_p" in r.stderr
