"""Gradients of the fused all-gather + RMSNorm + MXFP8 op (custom_vjp), under jit.

The reference is built from lax.all_gather + plain jnp RMSNorm inside the same shard_map, and
differentiated by jax itself; check_grads compares the custom VJP with finite differences.

Every mesh is all n of the run's devices; the ragged row counts are patterns repeated over them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import mxfp8_jax as mx
from mxfp8_jax._src.core.spmd import shard_map

from conftest import assert_same_bytes, need_devices
from rmsnorm_oracle import BF16

pytestmark = pytest.mark.skipif("cpu" not in mx.available_backends(), reason="needs the compiled CPU extension")

H = 64


def _counts(pattern, n):
    return tuple(pattern[k % len(pattern)] for k in range(n))


# One group of all n devices: ragged, (3, 0, 1, 4) at n = 4 (whose groups of two would gather 3
# and 5 rows: not equal), (3, 0) at n = 2.
COUNTS = (3, 0, 1, 4)
# Groups of two (so 4 devices at least for two groups), 4 rows each: (3, 1), (0, 4), (3, 1), ...
COUNTS_G = (3, 1, 0, 4)


def _reference(mesh, counts, group_size, offset, eps):
    """all_gather + jnp RMSNorm, per device; outputs stacked per device like the fused op."""
    m, g, n = max(counts), group_size, mesh.shape["x"]

    def local(xl, gl):
        groups = [list(range(k, k + g)) for k in range(0, n, g)] if g != n else None
        xg = jax.lax.all_gather(xl, "x", axis_index_groups=groups, tiled=True)
        # the group's valid rows, in device order: a row table per group
        table = np.array(
            [[k * m + l for k in range(g) for l in range(counts[grp * g + k])] for grp in range(n // g)], np.int32
        )
        rows = xg[jnp.asarray(table)[jax.lax.axis_index("x") // g]]
        xf = rows.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)
        normed = xf * inv * (gl.reshape(H).astype(jnp.float32) + offset)
        return normed.astype(rows.dtype), rows

    return shard_map(local, mesh, (P("x"), P("x")), (P("x"), P("x")))


def _fused(mesh, counts, group_size, offset, eps, strategy):
    def f(x, gamma):
        normed, _, _, residual = mx.allgather_rmsnorm_quant(
            x,
            gamma,
            mesh=mesh,
            axis="x",
            eps=eps,
            weight_offset=offset,
            group_size=group_size,
            row_counts=counts,
            strategy=strategy,
        )
        return normed, residual

    return f


def _loss(f, w1, w2):
    def loss(x, gamma):
        normed, residual = f(x, gamma)
        return jnp.sum(normed.astype(jnp.float32) * w1) + jnp.sum(residual.astype(jnp.float32) * w2)

    return loss


@pytest.mark.parametrize("strategy", ["xla", "p2p"])
@pytest.mark.parametrize("pattern,group_size,offset", [(COUNTS, None, 0.0), (COUNTS_G, 2, 1.0)])
def test_gradients_match_reference(devices, strategy, pattern, group_size, offset):
    """One ragged group of all n devices, and groups of two (two or more groups: 4 devices)."""
    if group_size is not None:
        need_devices(2 * group_size)
    n = len(devices) // 2 * 2
    group_size = group_size or n
    mesh = Mesh(np.array(devices[:n]), ("x",))
    counts = _counts(pattern, n)
    rng = np.random.default_rng(1)
    m = max(counts)
    x = jnp.asarray((rng.standard_normal((n * m, H)) * 2).astype(BF16))
    gamma = jnp.asarray((rng.standard_normal((n, H)) * 0.5 + 1).astype(BF16))  # per device
    r = sum(counts[:group_size])
    w1 = jnp.asarray(rng.standard_normal((n * r, H)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((n * r, H)), jnp.float32)

    fused = _fused(mesh, counts, group_size, offset, 1e-6, strategy)
    ref = _reference(mesh, counts, group_size, offset, 1e-6)  # in fp32 (check_grads'ed below)
    got = jax.jit(jax.grad(_loss(fused, w1, w2), argnums=(0, 1)))(x, gamma)
    want = jax.jit(jax.grad(_loss(ref, w1, w2), argnums=(0, 1)))(x.astype(jnp.float32), gamma.astype(jnp.float32))
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-2 * np.abs(b).max())
    # padding rows of a shard get no gradient
    gx = np.asarray(got[0], np.float32).reshape(n, m, H)
    for k, c in enumerate(counts):
        assert not gx[k, c:].any()
        assert c == 0 or gx[k, :c].any()


def test_shared_gamma_gradient_sums_over_devices(devices):
    """A replicated gamma [H] gets the sum of every device's contribution (one group of all n)."""
    n = len(devices)
    mesh = Mesh(np.array(devices), ("x",))
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((n * 2, H)).astype(BF16))
    gamma = jnp.asarray((rng.standard_normal(H) + 1).astype(BF16))

    def fused(x, gamma):
        normed = mx.allgather_rmsnorm_quant(x, gamma, mesh=mesh, axis="x", strategy="p2p")[0]
        return jnp.sum(normed.astype(jnp.float32) ** 2)

    def plain(x, gamma):
        xf = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)
        return jnp.sum((xf * inv * gamma.astype(jnp.float32)) ** 2)

    got = jax.jit(jax.grad(fused, argnums=(0, 1)))(x, gamma)
    want = jax.jit(jax.grad(plain, argnums=(0, 1)))(x, gamma)
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-2 * np.abs(b).max())


def test_reference_passes_check_grads(devices):
    """The fp32 reference the fused gradients are compared with agrees with finite
    differences (the fused op itself rounds to bf16, too coarse for finite differences), in its
    ragged groups of two over all n devices (one group at n = 2)."""
    n = len(devices) // 2 * 2
    mesh = Mesh(np.array(devices[:n]), ("x",))
    counts = _counts(COUNTS_G, n)
    rng = np.random.default_rng(3)
    m = max(counts)
    x = jnp.asarray(rng.standard_normal((n * m, H)), jnp.float32)
    gamma = jnp.asarray(rng.standard_normal((n, H)) * 0.5 + 1.0, jnp.float32)
    ref = jax.jit(_reference(mesh, counts, 2, 1.0, 1e-6))
    check_grads(ref, (x, gamma), order=1, modes=("rev",), eps=1e-2, atol=2e-2, rtol=2e-2)


def test_quant_and_scales_carry_no_gradient(devices):
    mesh = Mesh(np.array(devices[:2]), ("x",))
    x = jnp.asarray(np.ones((2, 32), BF16))
    gamma = jnp.asarray(np.ones(32, BF16))

    def loss(x, gamma):
        _, q, s, _ = mx.allgather_rmsnorm_quant(x, gamma, mesh=mesh, axis="x", strategy="xla")
        return jnp.sum(q.astype(jnp.float32)) + jnp.sum(s.astype(jnp.float32))

    gx, gg = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, gamma)
    assert not np.asarray(gx, np.float32).any() and not np.asarray(gg, np.float32).any()


@pytest.mark.parametrize("strategy", ["xla", "p2p"])
@pytest.mark.parametrize("gamma_spec", [P(), P("x")])
def test_local_form_under_checked_shard_map(devices, strategy, gamma_spec):
    """Inside a user's shard_map with its default varying-axes checking (check_vma=True), the
    per-device form traces, and its outputs and gradients are those of check_vma=False: a
    replicated (invariant) gamma gets the sum of the devices' cotangents either way. Groups of
    two over all n devices (one group at n = 2)."""
    n = len(devices) // 2 * 2
    mesh = Mesh(np.array(devices[:n]), ("x",))
    rng = np.random.default_rng(4)
    x = jnp.asarray((rng.standard_normal((n * 4, H)) * 2).astype(BF16))
    gamma = jnp.asarray((rng.standard_normal((n * H,) if gamma_spec == P("x") else (H,)) * 0.5 + 1).astype(BF16))
    w = jnp.asarray(rng.standard_normal((n * 2 * 4, H)), jnp.float32)  # each group gathers 8 rows

    def run(check_vma):
        def local(xl, gl, wl):
            normed, quant, scales, residual = mx.allgather_rmsnorm_quant_local(
                xl, gl, axis_name="x", group_size=2, strategy=strategy
            )
            loss = jnp.sum(normed.astype(jnp.float32) * wl) + jnp.sum(residual.astype(jnp.float32) * wl)
            return jax.lax.psum(loss, "x"), (normed, quant, scales)

        f = jax.shard_map(
            local, mesh=mesh, in_specs=(P("x"), gamma_spec, P("x")), out_specs=(P(), P("x")), check_vma=check_vma
        )
        (loss, outs), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, gamma, w)
        return loss, outs, grads

    (loss, outs, (dx, dg)), (loss0, outs0, (dx0, dg0)) = run(True), run(False)
    assert_same_bytes((loss, outs, dx), (loss0, outs0, dx0))
    dg, dg0 = np.asarray(dg, np.float32), np.asarray(dg0, np.float32)
    assert np.abs(dg).sum() > 0
    if gamma_spec == P("x"):
        np.testing.assert_array_equal(dg, dg0)
    else:
        # the unchecked transpose sums the devices' bf16-rounded shares; the checked one sums
        # in fp32 and rounds once: equal up to bf16 rounding (2^-8) of each term of an n-term sum
        tol = n * 2.0**-8
        np.testing.assert_allclose(dg, dg0, rtol=tol, atol=tol * np.abs(dg0).max())
