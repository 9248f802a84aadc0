"""The GPU kernels' device code, run on CPUs by HIP-CPU, byte for byte against the CPU kernels.

No GPU is needed: tests/hipcpu_build.py builds the kernels' ``.cu`` files with the host compiler
against HIP-CPU (ROCm's HIP runtime for CPUs: a block's threads run as fibers, in a fixed order,
switching at every barrier and lane exchange) once per vendor path, through the shims of
``xla_ffi/hipcpu/``:

- ``cuda``: the CUDA branches of the sources as nvcc's device pass for sm_90 sees them, the
  fast form included (its ``cvt.rn.satfinite.e4m3x2`` and ``__vmaxu2`` emulated from their
  documented semantics: the PTX itself does not run here), on 32-lane warps;
- ``rocm``: the HIP branches, with the amdgcn builtins (work-item ids, barrier, fences) mapped
  onto HIP-CPU's, on 64-lane wavefronts: what is tested is the ``#if`` branches and the code
  around the builtins, not the builtins.

Each test runs one driver executable (tests/hipcpu/driver.cc) over a batch of cases written to
files, and compares every plane it writes with the CPU kernels (``backend="ffi"`` of the 1x32 and
32x32 quantize, the segments kernel, the CPU fused gather), byte for byte. The driver starts
with flush-to-zero set, as XLA:CPU's threads have it, so the kernels must set the IEEE
environment themselves (the shim's launch does, in every worker thread). Output buffers start
poisoned, so an unwritten byte fails too; every buffer, inputs included, lies between guard bytes
and ends where an inaccessible page begins, so a read or write past its end stops the driver
naming the case.

Marked ``hipcpu`` (``-m hipcpu`` runs them alone). Without HIP-CPU they skip, saying how to get
it; with ``MXFP8_REQUIRE_HIPCPU=1`` (CI) they fail instead.
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh

import mxfp8_jax as mx
from mxfp8_jax._src.kernels import _ffi, ffi_calls

import hipcpu_build
from conftest import as_bytes

pytestmark = [pytest.mark.hipcpu, pytest.mark.xdist_group("hipcpu")]

BF16 = ml_dtypes.bfloat16
PATHS = hipcpu_build.PATHS
DRIVER_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def drivers() -> dict[str, Path]:
    if not _ffi.has_target("mxfp8_quantize", "cpu"):
        pytest.fail("the compiled CPU extension is missing: the HIP-CPU tests compare with its kernels")
    try:
        return hipcpu_build.executables()
    except hipcpu_build.Unavailable as err:
        if hipcpu_build.required():
            pytest.fail(f"MXFP8_REQUIRE_HIPCPU=1 but {err}")
        pytest.skip(str(err))


# ------------------------------------------------------------------------------------------------
# Cases: inputs written for the driver, and the CPU kernels' planes for them.


@dataclasses.dataclass
class Case:
    kind: str  # quantize, segments, rmsnorm, gather
    name: str
    params: dict  # the driver's key=value attributes (inputs by file)
    want: dict[str, np.ndarray]  # plane file suffix -> expected bytes


def _type(dtype) -> str:
    return {np.dtype(np.float32): "f32", np.dtype(BF16): "bf16", np.dtype(np.float16): "f16"}[np.dtype(dtype)]


def _f32_hex(v: float) -> str:
    return f"{int(np.float32(v).view(np.uint32)):08x}"


def _rule_code(rule: str) -> int:
    return mx.ScaleRule.parse(rule).code


@functools.cache
def _cpu_quantize(rule, rowwise, columnwise):
    return jax.jit(lambda x: mx.quantize(x, rowwise=rowwise, columnwise=columnwise, scale_rule=rule, backend="ffi"))


def quantize_case(name, x, rule="rceil", rowwise=True, columnwise=True) -> Case:
    x = np.ascontiguousarray(x)
    m, k = x.shape
    t = _cpu_quantize(rule, rowwise, columnwise)(jnp.asarray(x))
    want = {}
    if rowwise:
        want.update(row_q=as_bytes(t.rowwise_data), row_s=as_bytes(t.rowwise_scale))
    if columnwise:
        want.update(col_q=as_bytes(t.columnwise_data), col_s=as_bytes(t.columnwise_scale))
    params = dict(x=x, type=_type(x.dtype), M=m, K=k, rule=_rule_code(rule), rowwise=int(rowwise))
    params["columnwise"] = int(columnwise)
    return Case("quantize", name, params, want)


@functools.cache
def _cpu_segments(code, rowwise, columnwise):
    return jax.jit(
        lambda x, d: ffi_calls.quantize_segments(x, d, scale_rule=code, rowwise=rowwise, columnwise=columnwise)
    )


def segments_case(name, x, desc, rule="rceil", rowwise=True, columnwise=True) -> Case:
    desc64 = desc.dtype == np.int64
    with jax.enable_x64(desc64):
        (rq, rs), (cq, cs) = _cpu_segments(_rule_code(rule), rowwise, columnwise)(jnp.asarray(x), jnp.asarray(desc))
    want = {}
    if rowwise:
        want.update(row_q=as_bytes(rq), row_s=as_bytes(rs))
    if columnwise:
        want.update(col_q=as_bytes(cq), col_s=as_bytes(cs))
    params = dict(x=x, desc=desc, type=_type(x.dtype), S=x.size, P=len(desc), desc64=int(desc64))
    params.update(rule=_rule_code(rule), rowwise=int(rowwise), columnwise=int(columnwise))
    return Case("segments", name, params, want)


_NORM_PLANES = ("normed", "row_q", "row_s", "col_q", "col_s")


def _norm_params(h, eps, offset, fp32, columnwise, rule):
    return dict(
        H=h,
        eps=_f32_hex(eps),
        offset=_f32_hex(offset),
        fp32=int(fp32),
        columnwise=int(columnwise),
        rule=_rule_code(rule),
    )


@functools.cache
def _cpu_norm(eps, offset, quantize_from, columnwise, rule):
    return jax.jit(
        lambda x, g: mx.rmsnorm_quant(
            x,
            g,
            eps=eps,
            weight_offset=offset,
            quantize_from=quantize_from,
            columnwise=columnwise,
            scale_rule=rule,
            backend="ffi",
        )
    )


def rmsnorm_case(name, x, gamma, *, eps=1e-6, offset=0.0, fp32=False, columnwise=False, rule="rceil") -> Case:
    r, h = x.shape
    out = _cpu_norm(eps, offset, "fp32" if fp32 else "normed", columnwise, rule)(jnp.asarray(x), jnp.asarray(gamma))
    want = {plane: as_bytes(a) for plane, a in zip(_NORM_PLANES, out)}
    params = dict(x=x, gamma=gamma, R=r, **_norm_params(h, eps, offset, fp32, columnwise, rule))
    return Case("rmsnorm", name, params, want)


def gather_case(name, xs, gamma, *, eps=1e-6, offset=0.0, fp32=False, columnwise=False, rule="rceil") -> Case:
    """The fused gather's kernel over ranks whose valid rows are ``xs[k]``, against the CPU fused op
    (strategy="p2p") on as many CPU devices; with fewer devices than ranks, against the CPU kernel
    of the gathered rows (to which the fused op is byte-identical)."""
    n, h = len(xs), xs[0].shape[1]
    counts = [len(x) for x in xs]
    kw = dict(eps=eps, weight_offset=offset, quantize_from="fp32" if fp32 else "normed", columnwise=columnwise)
    cpus = jax.devices("cpu")
    rows = np.concatenate(xs)
    if len(cpus) >= n:
        rows_max = max(counts)
        padded = np.zeros((n * rows_max, h), BF16)
        for k, x in enumerate(xs):
            padded[k * rows_max : k * rows_max + len(x)] = x
        mesh = Mesh(np.array(cpus[:n]), ("x",))
        out = mx.allgather_rmsnorm_quant(
            jnp.asarray(padded),
            jnp.asarray(gamma),
            mesh=mesh,
            axis="x",
            row_counts=counts,
            strategy="p2p",
            scale_rule=rule,
            **kw,
        )
        normed, q, s, residual, *col = out
    else:
        normed, q, s, *col = mx.rmsnorm_quant(
            jnp.asarray(rows), jnp.asarray(gamma), scale_rule=rule, backend="ffi", **kw
        )
        residual = rows
    want = dict(normed=as_bytes(normed), row_q=as_bytes(q), row_s=as_bytes(s), residual=as_bytes(residual))
    if columnwise:
        want.update(col_q=as_bytes(col[0]), col_s=as_bytes(col[1]))
    np.testing.assert_array_equal(want["residual"], as_bytes(rows))  # the oracle gathers the rows
    params = dict(x=list(xs), rows=",".join(map(str, counts)), gamma=gamma)
    params.update(_norm_params(h, eps, offset, fp32, columnwise, rule))
    return Case("gather", name, params, want)


def run_driver(exe: Path, cases: list[Case], tmp: Path) -> dict[str, str]:
    """Writes the cases' inputs and runs the driver over them: {case name: "ok" or why not}."""
    lines = []
    for case in cases:
        attrs = []
        for key, value in case.params.items():
            if isinstance(value, list):  # one file per rank
                paths = [tmp / f"{case.name}.{key}{i}" for i in range(len(value))]
                for p, v in zip(paths, value):
                    np.ascontiguousarray(v).tofile(p)
                value = ",".join(map(str, paths))
            elif isinstance(value, np.ndarray):
                path = tmp / f"{case.name}.{key}"
                np.ascontiguousarray(value).tofile(path)
                value = path
            attrs.append(f"{key}={value}")
        attrs.append(f"out={tmp / case.name}")
        lines.append(" ".join([case.kind, *attrs]))
    manifest = tmp / "cases.txt"
    manifest.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([str(exe), "run", str(manifest)], capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S)
    status = {}
    for line in proc.stdout.splitlines():
        verdict, _, rest = line.partition(" ")
        name, _, why = rest.partition(": ")
        status[Path(name).name] = "ok" if verdict == "ok" else why
    assert proc.returncode in (0, 1) and len(status) == len(cases), (
        f"the driver stopped (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return status


def compare(exe: Path, cases: list[Case], tmp: Path) -> None:
    """Runs the cases on HIP-CPU and asserts every plane equals the CPU kernels' bytes."""
    status = run_driver(exe, cases, tmp)
    problems = []
    for case in cases:
        if status[case.name] != "ok":
            problems.append(f"{case.name}: {status[case.name]}")
            continue
        for plane, want in case.want.items():
            got = np.fromfile(tmp / f"{case.name}.{plane}", np.uint8)
            if got.size != want.size:
                problems.append(f"{case.name} {plane}: {got.size} bytes, want {want.size}")
                continue
            bad = np.flatnonzero(got != want)
            if bad.size:
                i = bad[0]
                problems.append(
                    f"{case.name} {plane}: {bad.size} of {want.size} bytes differ; first at {i}: "
                    f"got {got[i]:#04x}, want {want[i]:#04x}"
                )
    if problems:
        planes = sum(len(c.want) for c in cases)
        pytest.fail(f"{len(problems)} of {planes} planes differ from the CPU kernels:\n" + "\n".join(problems[:40]))


# ------------------------------------------------------------------------------------------------
# mxfp8_quantize


def _bits(dtype, bits):
    return np.asarray(bits).astype({2: np.uint16, 4: np.uint32}[np.dtype(dtype).itemsize]).view(dtype)


ALL_16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def _edge_blocks() -> np.ndarray:
    """fp32 rows of 32 whose maxima sit on the scale boundaries 448 * 2^k and one ulp either side,
    and zero, subnormal, NaN-only, Inf, mixed and largest-float rows."""
    rows = []
    with np.errstate(over="ignore"):  # 448 * 2^127 * (1 + ulp) overflows to Inf: a row of its own
        for k in range(-140, 128, 3):
            for mult in (1.0, np.nextafter(np.float32(1), np.float32(0)), np.nextafter(np.float32(1), np.float32(2))):
                amax = np.float32(448.0) * np.float32(mult) * np.float32(2.0 ** max(k, -149))
                row = np.linspace(-1, 1, 32, dtype=np.float32) * amax
                row[3] = amax
                rows.append(row)
    rows += [np.zeros(32, np.float32), -np.zeros(32, np.float32), np.full(32, np.float32(1e-45))]
    rows += [np.arange(32, dtype=np.float32) * np.float32(1e-45), np.full(32, np.nan, np.float32)]
    mixed = np.linspace(-3, 3, 32, dtype=np.float32)
    for special in (np.inf, -np.inf, np.nan, -np.nan, np.float32(448), np.float32(464), np.float32(-480)):
        r = mixed.copy()
        r[7] = special
        rows.append(r)
    rows.append(np.full(32, np.finfo(np.float32).max))
    rows.append(np.full(32, -np.finfo(np.float32).max))
    x = np.stack(rows)
    return x[: len(x) // 32 * 32]


@functools.cache
def quantize_cases() -> list[Case]:
    rng = np.random.default_rng(38)
    cases = []
    for rule in ("rceil", "floor"):
        # every bf16 and fp16 bit pattern, in consecutive blocks (both directions) and shuffled
        blocks = _bits(BF16, ALL_16).reshape(2048, 32)
        cases.append(quantize_case(f"bf16_all_rows_{rule}", blocks, rule))
        cases.append(quantize_case(f"bf16_all_cols_{rule}", np.ascontiguousarray(blocks.T), rule))
        shuffled = _bits(BF16, rng.permutation(ALL_16)).reshape(256, 256)
        cases.append(quantize_case(f"bf16_all_shuffled_{rule}", shuffled, rule))
        cases.append(quantize_case(f"f16_all_{rule}", _bits(np.float16, ALL_16).reshape(2048, 32), rule))
        cases.append(
            quantize_case(
                f"f16_all_shuffled_{rule}", _bits(np.float16, rng.permutation(ALL_16)).reshape(64, 1024), rule
            )
        )
        # every bf16 pattern beside block maxima that put it under every regime
        for companion in (2.0**-133, 1.0, 3.0e38):
            block = np.zeros((1 << 16, 32), BF16)
            block[:, 0] = _bits(BF16, ALL_16)
            block[:, 17] = companion
            cases.append(quantize_case(f"bf16_all_beside_{companion:g}_{rule}", block, rule, columnwise=False))
        # scale boundaries, specials, the largest float, 448 and above: fp32, bf16, fp16, both directions
        edges = _edge_blocks()
        for dt in (np.float32, BF16, np.float16):
            with np.errstate(over="ignore"):
                e = edges.astype(dt)
            cases.append(quantize_case(f"edges_{_type(dt)}_{rule}", e, rule))
            cases.append(quantize_case(f"edges_t_{_type(dt)}_{rule}", np.ascontiguousarray(e.T), rule))
        # fp32 subnormal inputs and tiny maxima; arbitrary fp32 bit patterns
        sub = rng.integers(1, 1 << 23, size=(64, 64), dtype=np.uint32) | (
            rng.integers(0, 2, size=(64, 64), dtype=np.uint32) << 31
        )
        sub[:, 32:] = rng.integers(1, 1 << 8, size=(64, 32), dtype=np.uint32)
        cases.append(quantize_case(f"f32_subnormal_{rule}", sub.view(np.float32), rule))
        bits = rng.integers(0, 2**32, (512, 256), dtype=np.uint64).astype(np.uint32)
        cases.append(quantize_case(f"f32_random_bits_{rule}", bits.view(np.float32), rule))
        # random data of every type: 17 blocks per row; scaled rows
        for dt in (np.float32, np.float16, BF16):
            scale = np.exp2(rng.integers(-20, 14, size=(96, 1)))
            x = (rng.standard_normal((96, 544)) * scale).astype(dt)
            cases.append(quantize_case(f"random_{_type(dt)}_{rule}", x, rule))
    # NaN and Inf inside blocks; a NaN in one warp only (the fast form's vote on the CUDA path)
    x = rng.normal(size=(64, 128)).astype(np.float32)
    x[0, 3], x[1, 40], x[2, 7], x[3, 70], x[40, 100], x[41, 100] = np.nan, -np.nan, np.inf, -np.inf, np.inf, np.nan
    x[4, :32] = np.nan
    for dt in (np.float32, BF16):
        cases.append(quantize_case(f"nan_inf_{_type(dt)}", x.astype(dt)))
    one = rng.normal(size=(256, 256)).astype(BF16)
    one[70, 200] = np.nan
    cases.append(quantize_case("one_nan_warp_bf16", one, "floor"))
    # zeros and negative zeros
    z = np.zeros((64, 96), np.float32)
    z[1::2] = -0.0
    for dt in (np.float32, BF16, np.float16):
        cases.append(quantize_case(f"zeros_{_type(dt)}", z.astype(dt)))
    # grid shapes: one lane group to many blocks; idle lanes (K/V not a multiple of 16)
    for m, k in ((32, 32), (64, 96), (96, 160), (64, 128), (384, 2048), (256, 4128)):
        for dt in (np.float32, BF16):
            x = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-30, 30, (m, 1)))).astype(dt)
            cases.append(quantize_case(f"shape_{m}x{k}_{_type(dt)}", x))
    # rowwise only, ragged row counts (a band's tail); columnwise only
    for rows in (1, 5, 7, 33, 1000):
        for dt in (np.float32, BF16):
            x = rng.standard_normal((rows, 160)).astype(dt)
            cases.append(quantize_case(f"ragged_{rows}_{_type(dt)}", x, columnwise=False))
    for dt in (np.float32, BF16, np.float16):
        x = rng.standard_normal((96, 288)).astype(dt)
        cases.append(quantize_case(f"columnwise_only_{_type(dt)}", x, rowwise=False))
    return cases


@pytest.mark.parametrize("path", PATHS)
def test_quantize_matches_the_cpu_kernel(drivers, path, tmp_path):
    compare(drivers[path], quantize_cases(), tmp_path)


# ------------------------------------------------------------------------------------------------
# mxfp8_quantize_tiles (32x32 blocks)


@functools.cache
def _cpu_tiles(rule):
    return jax.jit(lambda x: mx.quantize(x, blocks="32x32", scale_rule=rule, backend="ffi"))


def tiles_case(name, x, rule="rceil") -> Case:
    x = np.ascontiguousarray(x)
    m, k = x.shape
    t = _cpu_tiles(rule)(jnp.asarray(x))
    want = dict(q=as_bytes(t.data), s=as_bytes(t.scale))
    return Case("tiles", name, dict(x=x, type=_type(x.dtype), M=m, K=k, rule=_rule_code(rule)), want)


def _as_tiles(rows: np.ndarray, tiles_k: int) -> np.ndarray:
    """Rows of 32 (a multiple of 32 * tiles_k of them), 32 at a time made into 32x32 tiles: tile
    t holds rows 32t..32t+31, and the tiles lie tiles_k to a band."""
    t = rows.reshape(-1, tiles_k, 32, 32)  # [bands, tiles_k, 32 rows, 32 columns]
    return np.ascontiguousarray(t.transpose(0, 2, 1, 3).reshape(-1, tiles_k * 32))


@functools.cache
def tiles_cases() -> list[Case]:
    rng = np.random.default_rng(42)
    cases = []
    for rule in ("rceil", "floor"):
        # every bf16 and fp16 bit pattern: 1024 consecutive ones a tile, in a band and in a column
        # of tiles; shuffled
        cases.append(tiles_case(f"tiles_bf16_all_{rule}", _bits(BF16, ALL_16).reshape(2048, 32), rule))
        cases.append(tiles_case(f"tiles_bf16_all_band_{rule}", _as_tiles(_bits(BF16, ALL_16), 64), rule))
        shuffled = _bits(BF16, rng.permutation(ALL_16)).reshape(256, 256)
        cases.append(tiles_case(f"tiles_bf16_all_shuffled_{rule}", shuffled, rule))
        cases.append(tiles_case(f"tiles_f16_all_{rule}", _as_tiles(_bits(np.float16, ALL_16), 8), rule))
        # scale boundaries and specials (edge rows, 32 a tile, so each tile holds maxima of several
        # regimes and some a special), and one edge row a tile over small values, in each format
        edges = _edge_blocks()
        for dt in (np.float32, BF16, np.float16):
            with np.errstate(over="ignore"):
                cases.append(tiles_case(f"tiles_edges_{_type(dt)}_{rule}", _as_tiles(edges, 1).astype(dt), rule))
                one = np.zeros((len(edges), 32, 32), np.float32) + np.linspace(-1e-3, 1e-3, 32, dtype=np.float32)
                one[:, 9] = edges
                cases.append(tiles_case(f"tiles_edge_each_{_type(dt)}_{rule}", _as_tiles(one, 4).astype(dt), rule))
        # fp32 subnormals and tiny maxima; arbitrary fp32 bits
        sub = rng.integers(1, 1 << 23, size=(64, 96), dtype=np.uint32) | (
            rng.integers(0, 2, size=(64, 96), dtype=np.uint32) << 31
        )
        sub[:, 32:64] = rng.integers(1, 1 << 8, size=(64, 32), dtype=np.uint32)
        cases.append(tiles_case(f"tiles_f32_subnormal_{rule}", sub.view(np.float32), rule))
        bits = rng.integers(0, 2**32, (256, 256), dtype=np.uint64).astype(np.uint32)
        cases.append(tiles_case(f"tiles_f32_random_bits_{rule}", bits.view(np.float32), rule))
        # random data of every type, each tile at its own scale
        for dt in (np.float32, np.float16, BF16):
            scale = np.kron(np.exp2(rng.integers(-20, 14, size=(3, 17))), np.ones((32, 32)))
            x = (rng.standard_normal((96, 544)) * scale).astype(dt)
            cases.append(tiles_case(f"tiles_random_{_type(dt)}_{rule}", x, rule))
    # NaN of either sign and Inf inside tiles; a NaN in one tile only (the fast form's vote)
    x = rng.normal(size=(64, 128)).astype(np.float32)
    x[0, 3], x[33, 40], x[2, 70], x[40, 100], x[41, 101] = np.nan, -np.nan, np.inf, -np.inf, np.nan
    for dt in (np.float32, BF16, np.float16):
        cases.append(tiles_case(f"tiles_nan_inf_{_type(dt)}", x.astype(dt)))
    one = rng.normal(size=(128, 256)).astype(BF16)
    one[70, 200] = -np.nan
    cases.append(tiles_case("tiles_one_nan_tile_bf16", one, "floor"))
    z = np.zeros((64, 96), np.float32)
    z[1::2] = -0.0
    for dt in (np.float32, BF16, np.float16):
        cases.append(tiles_case(f"tiles_zeros_{_type(dt)}", z.astype(dt)))
    # grid shapes: one tile; one band; one column of tiles; a count of tiles that leaves a thread
    # block part empty; many tiles
    for m, k in ((32, 32), (32, 160), (160, 32), (96, 160), (64, 2048), (1024, 96)):
        for dt in (np.float32, BF16, np.float16):
            with np.errstate(over="ignore"):  # fp16 rows past 65504 are Inf rows
                x = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-30, 30, (m, 1)))).astype(dt)
            cases.append(tiles_case(f"tiles_shape_{m}x{k}_{_type(dt)}", x))
    return cases


@pytest.mark.parametrize("path", PATHS)
def test_tiles_match_the_cpu_kernel(drivers, path, tmp_path):
    compare(drivers[path], tiles_cases(), tmp_path)


# ------------------------------------------------------------------------------------------------
# mxfp8_quantize_segments


def _segment_desc(rng, s):
    """Pieces with gaps, in shuffled order, with unused rows: (table, pieces)."""
    pieces, at = [], 0
    while True:
        k = int(rng.choice([32, 96, 256, 1024]))
        rows = 32 * int(rng.integers(1, 4))
        off = at + 32 * int(rng.choice([0, 0, 1, 7, 40]))
        if off + rows * k > s:
            break
        pieces.append((off, rows, k))
        at = off + rows * k
    order = rng.permutation(len(pieces))
    return np.array([pieces[j] for j in order] + [(0, 0, 0)] * 2, np.int64)


@functools.cache
def segments_cases() -> list[Case]:
    rng = np.random.default_rng(39)
    cases = []
    for dt in (BF16, np.float16, np.float32):
        for rowwise, columnwise in ((True, True), (True, False), (False, True)):
            for seed in range(2):
                s = 1 << 15
                desc = _segment_desc(rng, s)
                x = (rng.standard_normal(s) * 4).astype(dt)
                x = np.where(rng.random(s) < 0.001, np.nan, x).astype(dt)  # some NaN tiles
                if seed == 1:
                    desc = desc.astype(np.int32)  # the table as jax passes it without x64
                rule = ("rceil", "floor")[seed]
                name = f"segments_{_type(dt)}_{int(rowwise)}{int(columnwise)}_{seed}"
                cases.append(segments_case(name, x, desc, rule, rowwise, columnwise))
    # many pieces: the table is staged in chunks of 128 entries (more than one chunk)
    s, pieces = 300 * 1024, []
    for i in range(300):
        if i % 3:
            pieces.append((i * 1024, 32, 32))
    desc = np.array(pieces + [(0, 0, 0)] * 5, np.int64)[rng.permutation(len(pieces) + 5)]
    x = rng.standard_normal(s).astype(BF16)
    cases.append(segments_case("segments_many_pieces", x, desc))
    return cases


@pytest.mark.parametrize("path", PATHS)
def test_segments_match_the_cpu_kernel(drivers, path, tmp_path):
    compare(drivers[path], segments_cases(), tmp_path)


# ------------------------------------------------------------------------------------------------
# mxfp8_rmsnorm_quantize


def _rows(rng, r, h, spread=20):
    return (rng.standard_normal((r, h)) * np.exp2(rng.integers(-spread, spread, (r, 1)))).astype(BF16)


def _gamma(rng, h):
    return (rng.standard_normal(h) * 0.5 + 1.0).astype(BF16)


@functools.cache
def rmsnorm_cases() -> list[Case]:
    rng = np.random.default_rng(40)
    cases = []
    # the rows kernel (rowwise only) with each row cache: 4, 8, 16 or 32 steps of 256 elements
    # (H up to 1024, 2048, 4096, 8192; the ROCm path stops at 8) and none (rows read again); H
    # not a multiple of 256; the bands kernel (columnwise too); from bf16 and from fp32
    shapes = [(1, 32), (33, 96), (64, 96), (32, 320), (64, 288), (32, 1536), (32, 2304), (32, 4096)]
    for r, h in shapes + [(32, 8192), (32, 8448), (8, 16384)]:
        for fp32 in (False, True):
            for columnwise in (False, True):
                if columnwise and r % 32:
                    continue
                rule = "floor" if (r + h) % 3 == 0 else "rceil"
                x, g = _rows(rng, r, h), _gamma(rng, h)
                name = f"rmsnorm_{r}x{h}_{'fp32' if fp32 else 'bf16'}_{'both' if columnwise else 'rows'}"
                offset = 1.0 if h % 64 else 0.0
                cases.append(
                    rmsnorm_case(name, x, g, eps=1e-5, offset=offset, fp32=fp32, columnwise=columnwise, rule=rule)
                )
    # zero rows (inv = 1/sqrt(eps)), Inf, NaN, subnormal results, a NaN gamma
    x = rng.standard_normal((64, 512)).astype(np.float32)
    x[0] = 0
    x[1, 5] = np.inf
    x[2, 9] = np.nan
    x[3] *= 1e-38
    x[4] *= 1e30  # its squares overflow: inv = 0, then Inf * 0
    x = x.astype(BF16)
    g = np.ones(512, BF16)
    g_nan = g.copy()
    g_nan[100] = np.nan
    for fp32 in (False, True):
        for columnwise in (False, True):
            kind = f"{'fp32' if fp32 else 'bf16'}_{'both' if columnwise else 'rows'}"
            cases.append(rmsnorm_case(f"specials_{kind}", x, g, fp32=fp32, columnwise=columnwise))
            cases.append(rmsnorm_case(f"nan_gamma_{kind}", x, g_nan, fp32=fp32, columnwise=columnwise, rule="floor"))
    tiny = (rng.standard_normal((32, 256)) * 1e-30).astype(BF16)
    cases.append(rmsnorm_case("subnormal_normed", tiny, (np.ones(256) * 1e-8).astype(BF16), eps=0.0, columnwise=True))
    return cases


@pytest.mark.parametrize("path", PATHS)
def test_rmsnorm_quantize_matches_the_cpu_kernel(drivers, path, tmp_path):
    compare(drivers[path], rmsnorm_cases(), tmp_path)


# ------------------------------------------------------------------------------------------------
# mxfp8_allgather_rmsnorm_quantize: the kernel over several simulated ranks


@functools.cache
def gather_cases() -> list[Case]:
    rng = np.random.default_rng(41)
    cases = []
    layouts = [
        ((3, 0, 17, 1, 9, 2, 0, 5), 1024, False, False, "rceil"),
        ((16, 48, 0, 32, 8, 24, 40, 24), 96, True, False, "floor"),
        ((5, 3, 4, 4), 512, False, True, "rceil"),
        ((32, 32), 2304, True, True, "rceil"),
        ((7, 9), 8448, False, False, "floor"),
        ((33,), 320, False, False, "rceil"),
    ]
    for counts, h, columnwise, fp32, rule in layouts:
        xs = [_rows(rng, c, h, spread=8) for c in counts]
        name = f"gather_{len(counts)}ranks_{h}_{'both' if columnwise else 'rows'}_{'fp32' if fp32 else 'bf16'}"
        cases.append(gather_case(name, xs, _gamma(rng, h), offset=1.0, fp32=fp32, columnwise=columnwise, rule=rule))
    return cases


@pytest.mark.parametrize("path", PATHS)
def test_gather_kernel_matches_the_cpu_fused_op(drivers, path, tmp_path):
    compare(drivers[path], gather_cases(), tmp_path)


# ------------------------------------------------------------------------------------------------
# The build, the fast form's emulation, the warp


def _driver(exe: Path, *args: str) -> str:
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_each_path_is_built_as_its_vendor_compiler_sees_the_sources(drivers):
    assert _driver(drivers["cuda"], "info").split() == ["path", "cuda", "warp", "32", "fast_form", "1"]
    assert _driver(drivers["rocm"], "info").split() == ["path", "rocm", "warp", "64", "fast_form", "0"]


def test_the_fast_form_emulation_matches_the_exact_cast(drivers):
    """cvt.rn.satfinite.e4m3x2 and __vmaxu2 as the CUDA path emulates them, against numerics.h's
    exact cast: every bf16 pattern at every scale byte, fp32 patterns at the E4M3 rounding
    points, a stride through all fp32 patterns; NaN gives a NaN code."""
    checks = {}
    for line in _driver(drivers["cuda"], "emulation").splitlines():
        what, _, checked, _, mismatches = line.split()
        checks[what] = (int(checked), int(mismatches))
    assert set(checks) == {"bf16", "f32", "nan", "vmaxu2"}
    assert checks["bf16"][0] > 255 * 65000 and checks["f32"][0] > 5_000_000
    assert all(bad == 0 for _, bad in checks.values()), checks


@pytest.mark.parametrize("path,warp", [("cuda", 32), ("rocm", 64)])
def test_a_vote_covers_the_warp_and_an_exchange_its_32_lane_group(drivers, path, warp):
    """any_lane votes over the hardware warp (32 lanes on NVIDIA, 64 on AMD), in a block of 128;
    a 32-wide exchange with lane t ^ 16 stays in t's group of 32."""
    lines = _driver(drivers[path], "warp").splitlines()
    assert len(lines) == 6
    for line in lines:
        _, voter, _, votes, _, *partners = line.split()
        voter = int(voter)
        want = "".join("1" if t // warp == voter // warp else "0" for t in range(128))
        assert votes == want, (path, voter)
        assert [int(p) for p in partners] == [t ^ 16 for t in range(128)]


def test_kernels_set_the_ieee_environment_in_every_worker(drivers):
    """The driver sets flush-to-zero and denormals-are-zero before anything runs, as XLA:CPU's
    threads have them; a kernel that did not set IEEE arithmetic itself would flush here."""
    for path in PATHS:
        out = _driver(drivers[path], "fpenv")
        assert out.split() == ["subnormals", "kept", "in", "128", "of", "128", "threads", "main", "ftz", "1"], out
