"""The model `flint generate` and `flint chat` run when no --model is given."""

from __future__ import annotations

from flint_jax.runtime import Runtime, random_tiny_runtime


def runtime() -> Runtime:
    # Until a trained demo model ships with the package, the default is the tiny config with random weights,
    # and the runtime's description says so plainly.
    return random_tiny_runtime()
