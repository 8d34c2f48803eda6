import flint_jax  # noqa: F401  (sets XLA_FLAGS before JAX starts)
import jax
import pytest

from flint_jax.config import FlintConfig
from flint_jax.params import init_params


@pytest.fixture(scope="session")
def tiny_cfg():
    return FlintConfig.tiny()


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
    return init_params(tiny_cfg, jax.random.key(0))


@pytest.fixture(scope="session")
def tiny_params_nvfp4(tiny_cfg):
    return init_params(tiny_cfg, jax.random.key(0), "nvfp4")
