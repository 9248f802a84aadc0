"""The p2p strategy under stress: many gathers in one program, loops, peers that never come,
and the argument errors of the fused op.

A blocking rendezvous deadlocks once a program holds more independent gathers than XLA:CPU
has threads to run them; these tests hold 64, mix groups with full-axis calls, loop 200 times,
and check every result against its own inputs so that mixed-up data cannot pass. Every mesh is
all n of the run's devices, every x one row (or two) a device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import mxfp8_jax as mx
from mxfp8_jax._src.ops import fused as fused_impl

from conftest import as_bytes
from rmsnorm_oracle import BF16, canonical

pytestmark = pytest.mark.skipif("cpu" not in mx.available_backends(), reason="needs the compiled CPU extension")

H = 32


def _mesh(devices):
    return Mesh(np.array(devices), ("x",))


def _x(seed, rows):
    return (np.random.default_rng(seed).standard_normal((rows, H)) * 2).astype(BF16)


def test_64_independent_calls_with_groups_interleaved(devices):
    mesh = _mesh(devices)
    n = len(devices)
    g = n // 2  # two groups (of one device each at n = 2, which meet nobody but still rendezvous)
    xs = np.stack([_x(k, n) for k in range(64)])  # [64, n, H]: one row per device per call
    gamma = np.ones(H, BF16)

    @jax.jit
    def many(xs, gamma):
        outs = []
        for k in range(64):
            group = g if k % 2 else None  # odd calls gather groups of n // 2, even ones the whole axis
            outs.append(
                mx.allgather_rmsnorm_quant(xs[k], gamma, mesh=mesh, axis="x", group_size=group, strategy="p2p")[0]
            )
        return outs

    outs = many(jnp.asarray(xs), jnp.asarray(gamma))
    for k, out in enumerate(outs):
        if k % 2:  # stacked per device: device d holds its group's g rows
            want = np.concatenate(
                [canonical(xs[k][(d // g) * g : (d // g) * g + g], gamma, eps=1e-6)[0] for d in range(n)]
            )
        else:
            want = canonical(xs[k], gamma, eps=1e-6)[0]
        np.testing.assert_array_equal(as_bytes(out), as_bytes(want), err_msg=f"call {k}")


def test_200_calls_in_a_scan(devices):
    mesh = _mesh(devices)
    n = len(devices)
    steps = 200
    xs = jnp.asarray(np.stack([_x(1000 + k, n) for k in range(steps)]).reshape(steps, n, H))
    gamma = jnp.asarray(np.ones(H, BF16))

    def run(strategy):
        def body(carry, xk):
            # per device: xk [steps, 1, H] sliced per step; carry makes steps depend in order
            normed, _, _, res = mx.allgather_rmsnorm_quant_local(xk + carry, gamma, axis_name="x", strategy=strategy)
            return carry + jnp.bfloat16(0), (normed, res)

        def local(xl):
            _, (normed, res) = jax.lax.scan(body, jnp.zeros((1, H), jnp.bfloat16), xl)
            return normed, res

        f = jax.shard_map(local, mesh=mesh, in_specs=P(None, "x"), out_specs=P(None, "x"), check_vma=False)
        return jax.jit(f)(xs)

    p2p = run("p2p")
    xla = run("xla")
    for a, b in zip(p2p, xla):
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))
    # step k of device d is the gather of step k (checks no step saw another step's rows)
    normed, res = (np.asarray(a) for a in p2p)  # [steps, n * n, H]: n device copies of n rows
    for k in (0, 1, 99, 199):
        np.testing.assert_array_equal(as_bytes(res[k, :n]), as_bytes(np.asarray(xs[k])))
        np.testing.assert_array_equal(
            as_bytes(normed[k, n : 2 * n]), as_bytes(canonical(np.asarray(xs[k]), np.ones(H, BF16), eps=1e-6)[0])
        )


def test_missing_peers_fail_with_deadline_and_process_stays_usable(devices):
    mesh = _mesh(devices)
    n = len(devices)
    x = jnp.asarray(_x(7, n))
    gamma = jnp.asarray(np.ones(H, BF16))

    def local(xl):
        def call(v):
            return mx.allgather_rmsnorm_quant_local(v, gamma, axis_name="x", strategy="p2p", p2p_timeout_s=1.0)[0]

        # ranks n // 2 .. n - 1 never reach the gather
        return jax.lax.cond(jax.lax.axis_index("x") < n // 2, call, lambda v: jnp.zeros((n, H), jnp.bfloat16), xl)

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    missing = ", ".join(str(r) for r in range(n // 2, n))  # "4, 5, 6, 7" at 8 devices
    with pytest.raises(Exception, match=rf"ranks \[{missing}\].*did not arrive") as info:
        jax.block_until_ready(f(x))
    assert "DEADLINE" in str(info.value).upper()
    # the process is still usable: a normal gather works and is right
    out = mx.allgather_rmsnorm_quant(x, gamma, mesh=mesh, axis="x", strategy="p2p")[0]
    np.testing.assert_array_equal(as_bytes(out), as_bytes(canonical(np.asarray(x), np.ones(H, BF16), eps=1e-6)[0]))


@pytest.mark.parametrize("timeout_s", [None, float("inf"), 1e10, 1e300])
def test_no_deadline_and_huge_timeouts_gather_normally(devices, timeout_s):
    # None/inf mean no deadline; 1e10 s (past the int64 nanoseconds of the clock: once a
    # deadline in the past, DEADLINE_EXCEEDED with every peer present) and 1e300 s (past
    # int64 milliseconds) saturate to none instead of overflowing
    mesh = _mesh(devices)
    x = _x(11, len(devices))
    gamma = np.ones(H, BF16)
    out = mx.allgather_rmsnorm_quant(x, gamma, mesh=mesh, axis="x", strategy="p2p", p2p_timeout_s=timeout_s)[0]
    np.testing.assert_array_equal(as_bytes(out), as_bytes(canonical(x, gamma, eps=1e-6)[0]))


@pytest.mark.parametrize("timeout_s", [0, -1.0, float("nan"), float("-inf"), "10", True])
def test_bad_timeouts_are_refused(devices, timeout_s):
    x = jnp.zeros((len(devices), H), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"p2p_timeout_s=.* must be a positive number of seconds, or None"):
        mx.allgather_rmsnorm_quant(x, jnp.ones(H, jnp.bfloat16), mesh=_mesh(devices), axis="x", p2p_timeout_s=timeout_s)


def test_vmap_of_p2p_gathers_each_batch_element(devices):
    # a batching rule (one rendezvous per element, in order), not JAX's NotImplementedError
    mesh = _mesh(devices)
    xs = np.stack([_x(20 + b, rows=2 * len(devices)) for b in range(3)])  # [B, 2 n, H]: 2 rows per device
    gamma = np.ones(H, BF16)
    op = lambda strategy: lambda x: mx.allgather_rmsnorm_quant(x, gamma, mesh=mesh, axis="x", strategy=strategy)
    p2p = jax.jit(jax.vmap(op("p2p")))(xs)
    xla = jax.jit(jax.vmap(op("xla")))(xs)
    for b in range(3):
        normed, _, _, residual = (np.asarray(o[b]) for o in p2p)
        np.testing.assert_array_equal(as_bytes(residual), as_bytes(xs[b]))
        np.testing.assert_array_equal(as_bytes(normed), as_bytes(canonical(xs[b], gamma, eps=1e-6)[0]))
    for a, b in zip(p2p, xla):
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))
    # and its gradient, through the same custom_vjp
    loss = lambda s: lambda x: jax.vmap(op(s))(x)[0].astype(jnp.float32).sum()
    np.testing.assert_array_equal(
        as_bytes(jax.jit(jax.grad(loss("p2p")))(xs)), as_bytes(jax.jit(jax.grad(loss("xla")))(xs))
    )


def test_p2p_across_processes_is_refused():
    with pytest.raises(ValueError, match="strategy='p2p' needs every device of axis 'x' in this process"):
        fused_impl._resolve_strategy("p2p", "cpu", False, "x")
    assert fused_impl._resolve_strategy("auto", "cpu", False, "x") == "xla"
    assert fused_impl._resolve_strategy("auto", "gpu", True, "x") == "xla"


def _bad_group_size(n):
    """The smallest group size from 3 up that does not divide n (3 at n = 2, 4, 8)."""
    return next(g for g in range(3, n + 2) if n % g)


# Each case, for a mesh of n devices with one row each (unless the case says otherwise):
# (shape, dtype, kwargs, error, message). The messages' numbers follow from n.
ERRORS = {
    "h-48": lambda n: ((n, 48), BF16, {}, ValueError, r"H=48 .*multiple of 32"),
    "float32-x": lambda n: ((n, 64), np.float32, {}, TypeError, r"float32.*bfloat16"),
    "counts-one-too-many": lambda n: (
        (n, 64),
        BF16,
        {"row_counts": (1,) * (n + 1)},
        ValueError,
        rf"{n + 1} entries.*one per device.*\({n}\)",
    ),
    "count-over-rows": lambda n: (
        (n, 64),
        BF16,
        {"row_counts": (2,) + (1,) * (n - 1)},
        ValueError,
        r"row_counts\[0\]=2 does not fit",
    ),
    "count-negative": lambda n: (
        (n, 64),
        BF16,
        {"row_counts": (-1,) + (1,) * (n - 1)},
        ValueError,
        r"row_counts\[0\]=-1",
    ),
    # two groups of n // 2: the first one's device 0 holds no row, so it gathers one row less
    "unequal-group-totals": lambda n: (
        (n, 64),
        BF16,
        {"row_counts": (0,) + (1,) * (n - 1), "group_size": n // 2},
        ValueError,
        rf"row totals \[{n // 2 - 1}, {n // 2}\]",
    ),
    "group-size-not-dividing": lambda n: (
        (n, 64),
        BF16,
        {"group_size": _bad_group_size(n)},
        ValueError,
        rf"group_size={_bad_group_size(n)} must divide the size {n}",
    ),
    # 64 rows (R = 64, whole columnwise blocks) must NOT raise
    "columnwise-r-64": lambda n: ((64, 64), BF16, {"columnwise": True}, None, None),
    "columnwise-r-not-32s": lambda n: (
        (n, 64),
        BF16,
        {"columnwise": True},
        ValueError,
        rf"R={n} gathered rows.*multiple of 32",
    ),
    "strategy-nccl": lambda n: ((n, 64), BF16, {"strategy": "nccl"}, ValueError, r"strategy='nccl'"),
    "quantize-from-bf16": lambda n: ((n, 64), BF16, {"quantize_from": "bf16"}, ValueError, r"quantize_from='bf16'"),
    # 3 n / 2 rows (12 at 8 devices) do not split over n devices
    "rows-not-splitting": lambda n: ((3 * n // 2, 64), BF16, {}, ValueError, rf"{3 * n // 2} rows.*{n} devices"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_errors(devices, case):
    n = len(devices)
    shape, dtype, kwargs, err, match = ERRORS[case](n)
    mesh = _mesh(devices)
    x = jnp.zeros(shape, dtype)
    gamma = jnp.ones(shape[1], jnp.bfloat16)
    if err is None:  # this one must NOT raise
        mx.allgather_rmsnorm_quant(x, gamma, mesh=mesh, axis="x", strategy="xla", **kwargs)
        return
    with pytest.raises(err, match=match):
        mx.allgather_rmsnorm_quant(x, gamma, mesh=mesh, axis="x", **kwargs)


def test_gamma_errors(devices):
    mesh = _mesh(devices)
    n = len(devices)
    x = jnp.zeros((n, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match="gamma has dtype float32"):
        mx.allgather_rmsnorm_quant(x, jnp.ones(64), mesh=mesh, axis="x")
    # a per-device gamma has n rows: 2 n is not one
    with pytest.raises(ValueError, match=rf"gamma has shape \({2 * n}, 64\)"):
        mx.allgather_rmsnorm_quant(x, jnp.ones((2 * n, 64), jnp.bfloat16), mesh=mesh, axis="x")
    with pytest.raises(ValueError, match="axis='y' is not an axis"):
        mx.allgather_rmsnorm_quant(x, jnp.ones(64, jnp.bfloat16), mesh=mesh, axis="y")
