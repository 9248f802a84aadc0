"""All-gather + RMSNorm + MXFP8 quantize across devices: strategies agree byte for byte.

Every case runs the "xla" (lax.all_gather + local kernel) and "p2p" (in-process rendezvous)
strategies on the run's devices and checks, on every device's copy: normed against the
numpy oracle of the canonical order (bytes) and float64 (1 ulp); quant/scales against the
pure-JAX quantize of normed; residual against the gathered input bits; equality of the two
strategies on all outputs; identical outputs on the devices of a group.

The cases are written for the run's device count n (MXFP8_TEST_DEVICES): besides two fixed
2-device cases, each spans all n devices, with ragged row counts and two groups of n // 2
(groups of one device at n = 2) derived from n, so that every feature runs at every count.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import mxfp8_jax as mx
from mxfp8_jax._src.compiled import hlo

from conftest import as_bytes, device_count, need_devices
from rmsnorm_oracle import BF16, canonical, float64, within_one_bf16_ulp

pytestmark = pytest.mark.skipif("cpu" not in mx.available_backends(), reason="needs the compiled CPU extension")


@dataclasses.dataclass(frozen=True)
class Case:
    n: int
    counts: tuple
    h: int
    group_size: int | None = None
    per_device_gamma: bool = False
    eps: float = 1e-6
    offset: float = 0.0
    columnwise: bool = False
    quantize_from: str = "normed"


def _cycle(pattern, n):
    """``pattern`` repeated over ``n`` devices."""
    return tuple(pattern[k % len(pattern)] for k in range(n))


def _two_groups(pattern, n):
    """Row counts for two groups of ``n // 2`` devices that gather the same number of rows: the
    first group cycles ``pattern``, the second swaps its neighbours pairwise (the same total).
    At n = 8 and pattern (17, 0, 2, 1): (17, 0, 2, 1, 0, 17, 1, 2)."""
    first = _cycle(pattern, n // 2)
    second = tuple(first[k ^ 1] if (k ^ 1) < len(first) else first[k] for k in range(len(first)))
    return first + second


def _cases(n):
    """The cases of a run with n devices (the even part of it: two groups need an even count)."""
    n = max(2, n // 2 * 2)
    return [
        Case(2, (1, 1), 32),
        Case(n, _cycle((0, 17, 2, 1), n), 96, per_device_gamma=True, offset=1.0, eps=1e-5),
        Case(n, (128,) * n, 64),
        Case(n, _two_groups((17, 0, 2, 1), n), 8192, group_size=n // 2, offset=1.0),
        Case(n, (2,) * n, 256, group_size=n // 2, per_device_gamma=True),
        # pairs (32, 0) and (16, 16): R = 32 per pair, a multiple of 32 as columnwise needs
        Case(n, _cycle((32, 0, 16, 16), n), 160, columnwise=True, quantize_from="fp32", per_device_gamma=True),
        Case(n, (1,) * n, 6144),
        Case(2, (0, 0), 32),
    ]


CASES = _cases(device_count())


@functools.partial(jax.jit, static_argnums=1)
def _reference_quantize(src, columnwise):
    return mx.quantize(src, columnwise=columnwise, backend="jax")


@jax.jit
def _quantize(src):
    return mx.quantize(src, columnwise=False)


def _mesh(devices, n):
    return Mesh(np.array(devices[:n]), ("x",))


def _inputs(case: Case, seed=0):
    rng = np.random.default_rng(seed)
    m = max(case.counts)
    x = (rng.standard_normal((case.n * m, case.h)) * 2.0).astype(BF16)
    shape = (case.n, case.h) if case.per_device_gamma else (case.h,)
    gamma = (rng.standard_normal(shape) * 0.5 + 1.0).astype(BF16)
    return x, gamma


def _gathered(case: Case, x, group):
    """The group's valid rows, in device order (numpy)."""
    m, g = max(case.counts), case.group_size or case.n
    ks = range(group * g, (group + 1) * g)
    return np.concatenate([x[k * m : k * m + case.counts[k]] for k in ks]).reshape(-1, case.h)


def _device_copies(out, case: Case):
    """Each device's copy of one output: stacked [n*r, ...] or replicated [r, ...]."""
    stacked = case.group_size not in (None, case.n) or case.per_device_gamma
    if stacked:
        a = np.asarray(out)
        r = a.shape[0] // case.n
        return [a[k * r : (k + 1) * r] for k in range(case.n)]
    shards = sorted(out.addressable_shards, key=lambda s: s.device.id)
    return [np.asarray(s.data) for s in shards]


def _run(case: Case, strategy, devices, x, gamma):
    return mx.allgather_rmsnorm_quant(
        jnp.asarray(x),
        jnp.asarray(gamma),
        mesh=_mesh(devices, case.n),
        axis="x",
        eps=case.eps,
        weight_offset=case.offset,
        group_size=case.group_size,
        row_counts=case.counts,
        quantize_from=case.quantize_from,
        columnwise=case.columnwise,
        strategy=strategy,
    )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_strategies_agree_and_match_oracles(case, devices):
    x, gamma = _inputs(case)
    outs = {s: _run(case, s, devices, x, gamma) for s in ("xla", "p2p")}
    for a, b in zip(outs["xla"], outs["p2p"]):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))

    g = case.group_size or case.n
    r = sum(case.counts[:g])
    names = ["normed", "quant", "scales", "residual", "col_quant", "col_scales"]
    copies = {nm: _device_copies(o, case) for nm, o in zip(names, outs["p2p"])}
    seen = set()
    for k in range(case.n):
        # devices with the same rows and gamma hold the same bytes (checked below)
        variant = (k // g, k if case.per_device_gamma else -1)
        if variant in seen:
            continue
        seen.add(variant)
        rows = _gathered(case, x, k // g)
        gam = gamma[k] if case.per_device_gamma else gamma
        normed_want, y = canonical(rows, gam, eps=case.eps, offset=case.offset)
        normed = copies["normed"][k]
        assert normed.shape == (r, case.h)
        np.testing.assert_array_equal(as_bytes(normed), as_bytes(normed_want))
        assert within_one_bf16_ulp(normed, float64(rows, gam, eps=case.eps, offset=case.offset)).all()
        np.testing.assert_array_equal(as_bytes(copies["residual"][k]), as_bytes(rows))
        # shapes and dtypes: for zero rows they are all there is to check (the bytes are empty)
        assert copies["residual"][k].shape == (r, case.h) and copies["residual"][k].dtype == BF16
        assert copies["quant"][k].shape == (r, case.h) and copies["quant"][k].dtype == jnp.float8_e4m3fn
        assert copies["scales"][k].shape == (r, case.h // 32) and copies["scales"][k].dtype == np.uint8
        if case.columnwise:
            assert copies["col_quant"][k].shape == (r, case.h) and copies["col_scales"][k].shape == (r // 32, case.h)
        if r == 0:
            continue
        src = y if case.quantize_from == "fp32" else normed
        ref = _reference_quantize(jnp.asarray(src), case.columnwise)
        np.testing.assert_array_equal(as_bytes(copies["quant"][k]), as_bytes(ref.rowwise_data))
        np.testing.assert_array_equal(as_bytes(copies["scales"][k]), as_bytes(ref.rowwise_scale))
        if case.columnwise:
            np.testing.assert_array_equal(as_bytes(copies["col_quant"][k]), as_bytes(ref.columnwise_data))
            np.testing.assert_array_equal(as_bytes(copies["col_scales"][k]), as_bytes(ref.columnwise_scale))
        if case.quantize_from == "normed":  # quant is mx.quantize(normed) of this very output
            mine = _quantize(jnp.asarray(normed))
            np.testing.assert_array_equal(as_bytes(copies["quant"][k]), as_bytes(mine.rowwise_data))
    # all devices of a group hold the same bytes (normed only where gammas are shared)
    for k in range(case.n):
        lead = (k // g) * g
        for nm in ("residual",) + (() if case.per_device_gamma else ("normed", "quant", "scales")):
            np.testing.assert_array_equal(as_bytes(copies[nm][k]), as_bytes(copies[nm][lead]))


def _hlo(case: Case, strategy, devices, *, grad=False):
    x, gamma = (jnp.asarray(a) for a in _inputs(case))

    def fwd(x, gamma):
        return _run(case, strategy, devices, x, gamma)

    def loss(x, gamma):
        normed, _, _, residual = fwd(x, gamma)
        return jnp.sum(normed.astype(jnp.float32)) + jnp.sum(residual.astype(jnp.float32))

    f = jax.grad(loss, argnums=(0, 1)) if grad else fwd
    return jax.jit(f).lower(x, gamma).compile().as_text()


def _gather_groups(text: str) -> list[list[tuple[int, ...]]]:
    """The device groups of each all-gather in ``text``. XLA writes them as a list
    (``replica_groups={{0,1,2,3},{4,5,6,7}}``), or, for a gather over a whole axis of a 1-D mesh,
    by the axis (``replica_groups=mesh['x'=2] {'x'}``: one group of every device)."""
    out = []
    for line in text.splitlines():
        if " all-gather(" not in line and " all-gather-start(" not in line:
            continue
        listed = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
        by_axis = re.search(r"replica_groups=mesh\['(\w+)'=(\d+)\] \{'(\w+)'\}", line)
        if listed:
            out.append([tuple(int(d) for d in g.split(",") if d) for g in re.findall(r"\{([\d,]*)\}", listed[1])])
        elif by_axis and by_axis[1] == by_axis[3]:
            out.append([tuple(range(int(by_axis[2])))])
        else:
            raise AssertionError(f"an all-gather whose replica groups this test does not read: {line.strip()}")
    return out


def test_hlo_collectives(devices):
    """Two groups of n // 2 devices (one group of both at n = 2: a group of one gathers nothing)."""
    n = len(devices) // 2 * 2
    g = n // 2 if n >= 4 else n
    case = Case(n, _two_groups((3, 1, 2, 0), n) if g < n else (3, 1), 64, group_size=g)
    xla = _hlo(case, "xla", devices)
    assert "all-gather" in xla and "mxfp8_rmsnorm_quantize" in xla
    groups = [tuple(range(k, k + g)) for k in range(0, n, g)]
    assert _gather_groups(xla) == [groups]  # at 8 devices: {{0,1,2,3},{4,5,6,7}}
    # the bf16 rows travel as 16-bit words (XLA:CPU would widen a bf16 gather to f32)
    assert [c.dtypes for c in hlo.collectives(xla) if c.op == "all-gather"] == [("u16",)]
    p2p = _hlo(case, "p2p", devices)
    assert "mxfp8_allgather_rmsnorm_quantize" in p2p
    assert hlo.collectives(p2p) == []
    # backward: the transpose of the gather is a reduce-scatter over the group, for both
    for strategy in ("xla", "p2p"):
        text = _hlo(case, strategy, devices, grad=True)
        assert "reduce-scatter" in text
        assert ("all-gather" in text) == (strategy == "xla")


def test_auto_strategy_is_p2p_on_cpu(devices):
    """The strategy "auto" is "p2p" on CPU devices and "xla" on GPUs (MXFP8_TEST_PLATFORM=gpu)."""
    n = len(devices)
    auto = _hlo(Case(n, (2,) * n, 32), "auto", devices)
    if devices[0].platform == "cpu":
        assert "mxfp8_allgather_rmsnorm_quantize" in auto and "all-gather" not in auto
    else:
        assert "mxfp8_allgather_rmsnorm_quantize" not in auto and "all-gather" in auto


def test_per_device_form_in_user_shard_map(devices):
    """The per-device form gathers over one axis ("tp") of a (2, n // 2) mesh: both axes cut, so
    4 devices at least."""
    need_devices(4)
    tp = len(devices) // 2
    mesh = Mesh(np.array(devices[: 2 * tp]).reshape(2, tp), ("dp", "tp"))
    rng = np.random.default_rng(5)
    x = jnp.asarray((rng.standard_normal((2 * tp * 3, 64))).astype(BF16))  # 3 rows a device
    gamma = jnp.asarray(np.ones(64, BF16))
    from jax.sharding import PartitionSpec as P

    def body(xl, gl, strategy):
        normed, q, s, res = mx.allgather_rmsnorm_quant_local(xl, gl, axis_name="tp", strategy=strategy)
        return normed, res

    outs = []
    for strategy in ("xla", "p2p"):
        f = jax.jit(
            jax.shard_map(
                lambda a, b: body(a, b, strategy),
                mesh=mesh,
                in_specs=(P(("dp", "tp")), P()),
                out_specs=(P("dp"), P("dp")),
                check_vma=False,
            )
        )
        outs.append(f(x, gamma))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))
    # the dp row d gathers devices (d, 0..tp-1): rows [3 tp d, 3 tp (d + 1)) of x
    np.testing.assert_array_equal(as_bytes(outs[1][1]), as_bytes(x))


def _partly_manual(devices, grouped: bool, **kw):
    """The per-device op over "tp" in a shard_map manual over tp only, on a (n / 2, 2)
    ("fsdp", "tp") mesh whose rows XLA keeps split over the automatic fsdp axis (an FSDP step
    under tensor parallelism): outputs, compiled HLO, input."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    need_devices(4)
    f = len(devices) // 2
    mesh = Mesh(np.array(devices[: 2 * f]).reshape(f, 2), ("fsdp", "tp"))
    rows = 32 * f  # each tp rank's rows: 32 per device of the fsdp axis (whole columnwise blocks)
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((2 * rows, 64)).astype(BF16))
    gamma = jnp.asarray(rng.standard_normal(64).astype(BF16))
    body = functools.partial(mx.allgather_rmsnorm_quant_local, axis_name="tp", grouped=grouped, **kw)
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P(), axis_names={"tp"}, check_vma=False)
    )
    placed = jax.device_put(x, NamedSharding(mesh, P(("tp", "fsdp"))))
    return fn(placed, gamma), fn.lower(placed, gamma).compile().as_text(), x, gamma


def test_grouped_outputs_keep_the_automatic_axes_row_split(devices):
    """``grouped=True``: the same bytes as the flat outputs and as the unfused op on the
    gathered rows, as ``[member, rows, ...]``; with the rows split over an automatic mesh axis
    the compiled program then moves nothing but the fused call's own gather, while the flat
    outputs (members' rows interleaved with that split) make XLA gather every output."""
    grouped, text, x, gamma = _partly_manual(devices, True, columnwise=True)
    flat, flat_text, _, _ = _partly_manual(devices, False, columnwise=True)
    want = mx.rmsnorm_quant(x, gamma, columnwise=True)
    want = (*want[:3], x, *want[3:])  # the op's order: normed, quant, scales, residual, columnwise
    assert len(grouped) == len(flat) == len(want) == 6
    for g, fl, w in zip(grouped, flat, want):
        assert g.shape == (2, w.shape[0] // 2, w.shape[1])
        assert fl.shape == w.shape
        np.testing.assert_array_equal(as_bytes(g), as_bytes(w))
        np.testing.assert_array_equal(as_bytes(fl), as_bytes(w))
    assert [c.target for c in hlo.custom_calls(text)] == ["mxfp8_allgather_rmsnorm_quantize"]
    assert hlo.collectives(text) == []
    assert {c.op for c in hlo.collectives(flat_text)} == {"all-gather"}


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(grouped=1), TypeError, r"grouped=1 must be True or False"),
        (
            dict(grouped=True, row_counts=(15, 16)),
            ValueError,
            r"grouped=True needs every device's row count equal to rows_max=16",
        ),
        # 16 rows a device: the gathered 32 make whole blocks, each member's 16 do not
        (
            dict(grouped=True, columnwise=True),
            ValueError,
            r"grouped=True with columnwise=True needs rows_max a multiple of 32.*rows_max=16",
        ),
    ],
    ids=["not-bool", "ragged", "columnwise-part-block"],
)
def test_grouped_errors(devices, kw, err, match):
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices[:2]), ("tp",))
    x, gamma = jnp.zeros((32, 64), jnp.bfloat16), jnp.ones(64, jnp.bfloat16)
    body = functools.partial(mx.allgather_rmsnorm_quant_local, axis_name="tp", **kw)
    with pytest.raises(err, match=match):
        jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P(), check_vma=False)(x, gamma)
