"""Packaging facts a user relies on: import names, and the numerics flag set at import."""
import os
import subprocess
import sys


def run_python(code, cwd):
    """A fresh interpreter without XLA_FLAGS (this test process has set them by importing flint_jax)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


def test_no_generic_top_level_packages(tmp_path):
    r = run_python("import importlib.util as u; print(u.find_spec('convert'), u.find_spec('pallas_kernels'));"
                   "import flint_jax.convert, flint_jax.pallas_kernels; print('ok')", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["None", "None", "ok"]


def test_import_sets_the_rounding_flag_and_warns_when_too_late(tmp_path):
    r = run_python("import os, flint_jax; print(os.environ['XLA_FLAGS'])", cwd=tmp_path)
    assert "--xla_allow_excess_precision=false" in r.stdout and "imported after JAX" not in r.stderr
    r = run_python("import jax.numpy as jnp; jnp.ones(1); import flint_jax", cwd=tmp_path)
    assert "imported after JAX started its backends" in r.stderr
