"""``compiled.xla_costs`` where no GPU compiler runs: the jit that compiles with prices put
right compiles once per signature of its arguments and gives ``jax.jit``'s values, a profile
of the user's own wins, and ``FSDP`` checks the option. What the prices do to XLA:GPU's
schedule is in tests/test_gpu_compile.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from mxfp8_jax import models
from mxfp8_jax._src.compiled import xla_costs
from mxfp8_jax.flax import FSDP


def test_the_corrected_jit_compiles_once_per_signature_and_gives_jits_values(monkeypatch):
    calls = []
    real = xla_costs.compile

    def counted(lowered, options=None):
        compiled, found = real(lowered, options)
        calls.append(found)
        return compiled, found

    monkeypatch.setattr(xla_costs, "compile", counted)
    f = lambda x, y: (x * y + 1).sum(axis=0)
    step = xla_costs.CorrectedJit(jax.jit(f))
    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(step(x, x), jax.jit(f)(x, x))
    np.testing.assert_array_equal(step(x + 1, x), jax.jit(f)(x + 1, x))
    assert len(calls) == 1  # the same types: the compiled program again
    xb = x.astype(jnp.bfloat16)
    np.testing.assert_array_equal(step(xb, xb), jax.jit(f)(xb, xb))
    assert len(calls) == 2
    # XLA:CPU runs no latency-hiding scheduler: nothing to put right, compiled once
    assert calls == [None, None]
    assert step.lower(x, x).as_text() == jax.jit(f).lower(x, x).as_text()


def test_a_profile_of_the_users_own_wins():
    assert not xla_costs.user_profiled({}, "--xla_gpu_enable_latency_hiding_scheduler=true")
    assert xla_costs.user_profiled({}, "--xla_gpu_pgle_profile_file_or_directory_path=/profiles")
    assert xla_costs.user_profiled({xla_costs.PROFILE_OPTION: "/profiles"}, "")
    assert xla_costs.user_profiled({"fdo_profile": b"costs {}"}, "")


def test_the_profile_names_each_repriced_instruction_once():
    found = xla_costs.Corrections({"gemm_fusion_dot.3": 49.25}, {"fusion-start.1": 2.5}, 3.35e12)
    assert found and not xla_costs.Corrections({}, {}, 1e12)
    assert found.profile() == (
        'costs { name: "fusion-start.1" cost_us: 2.5 }\ncosts { name: "gemm_fusion_dot.3" cost_us: 49.25 }\n'
    )


def test_fsdp_checks_xla_costs():
    mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    model = models.TransformerLM(
        models.TransformerConfig(vocab=64, hidden=64, heads=2, head_dim=32, mlp=128, layers=1), rngs=nnx.Rngs(0)
    )
    with pytest.raises(ValueError, match=r"xla_costs='fast' must be one of \('corrected', 'xla'\)"):
        FSDP(model, mesh, xla_costs="fast")
    assert FSDP(model, mesh, xla_costs="xla").xla_costs == "xla"
