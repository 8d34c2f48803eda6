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


@pytest.fixture
def lower_for_h200(monkeypatch):
    """Pallas' Triton lowering for CUDA sees an H200 described abstractly (no GPU needed): tests lower kernels with
    `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` to catch what interpret mode accepts but the
    lowering does not."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info",
                        lambda: gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200))
