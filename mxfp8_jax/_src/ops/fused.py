"""All-gather + RMSNorm + MXFP8 quantize over a mesh axis: strategies, ragged shards, gradients.

The rows of a group of devices are gathered and each gathered row gets the RMSNorm + MXFP8
numerics of ``rmsnorm`` (``normed``, ``quant``, ``scales``, byte-identical to the local op on
the gathered rows), plus ``residual [R, H]`` bf16: the gathered ``x``, bit for bit.

Strategies:

- ``"xla"``: ``lax.all_gather`` (grouped with ``axis_index_groups``), then the local fused kernel
  ``mxfp8_rmsnorm_quantize`` (the pure-JAX reference of the same order where no kernel is
  installed for the platform). Works everywhere, multi-host included.
- ``"p2p"``: one custom call per device (``mxfp8_allgather_rmsnorm_quantize``) in which the
  devices of a group meet in process, exchange their input buffers and read the rows straight
  from their peers while normalizing and quantizing; no separate gather pass. It needs every
  device of the group in this process; peers that cannot meet give a DEADLINE_EXCEEDED error
  after ``p2p_timeout_s``, never a hang (``None`` or ``inf``: no deadline; a bound past what
  the clock can hold is no deadline either, never an overflow).
- ``"auto"``: ``"p2p"`` on CPU when every device of the axis is in this process (and the
  extension is installed), ``"xla"`` otherwise -- in particular on GPUs, whose p2p path is
  opt-in until it has run on multi-GPU hardware. The platform is the program's: the mesh's
  devices for the global op; for the per-device op, the platform it is lowered for
  (``lax.platform_dependent``), so a step compiled for GPUs from a CPU host gathers with XLA.

``"p2p"`` on GPUs (CUDA or ROCm; experimental, asked for explicitly, with a one-time
:class:`ExperimentalGpuP2PWarning`): each GPU of the group runs the kernel for the whole group,
reading its peers' rows over peer access (NVLink or PCIe P2P). The handlers block on their
per-device host threads while the group meets: a "ready" event per input orders the reads
after the peers' producers, a "done" event per kernel keeps every device from reusing its input
while a peer still reads it. Each call also copies the 12-byte ``where`` operand to the host
(the host needs the rank and group to meet), which waits for the device to catch up, so the
host no longer runs ahead of that GPU at this op. GPUs that cannot access each other's memory
give a FAILED_PRECONDITION error that suggests ``strategy="xla"``; groups are limited to 16
devices. ``tests/test_gpu.py`` checks it against ``"xla"`` (one GPU, and several where present);
docs/limits.md says where it has run.

Gradients (``custom_vjp``): ``normed`` and ``residual`` carry them to ``x`` -- through the
transpose of the gather, a reduce-scatter -- and ``normed`` to ``gamma``; ``quant`` and
``scales`` carry none. The bf16 rounding of ``normed`` is treated as the identity.

``vmap``: both strategies batch, each batch element gathered on its own; ``"p2p"`` runs its
custom call once per element in a loop (``vmap_method="sequential"``), ``"xla"`` batches the
all-gather and loops its local kernel the same way.

Ragged shards: ``row_counts[k]`` is the number of valid rows of device ``k`` along the axis;
local inputs are padded to the largest count (valid rows first) and a device may own none.
A group's rows are its devices' valid rows in device order.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import numbers
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mxfp8_jax._src.core import platforms, spmd, vma
from mxfp8_jax._src.core.tracing import is_traced
from mxfp8_jax._src.kernels import _ffi, ffi_calls
from mxfp8_jax._src.numerics import format as fmt
from mxfp8_jax._src.ops import rmsnorm

STRATEGIES = ("auto", "xla", "p2p")
CPU_P2P = "p2p-on-cpu"  # "auto" resolved by the lowering platform: "p2p" on CPU, "xla" elsewhere
_P2P_TARGET = "mxfp8_allgather_rmsnorm_quantize"
DEFAULT_P2P_TIMEOUT_S = 120.0

# One id per traced p2p call site: with the execution's RunId and the group id it keys the
# rendezvous in which the devices of one group meet.
_op_ids = itertools.count(1)


# ------------------------------------------------------------------------------------------------
# static configuration


@dataclasses.dataclass(frozen=True)
class _GatherConfig:
    """One fused call as one device sees it (static; hashable for custom_vjp)."""

    axis_name: str
    axis_size: int
    group_size: int
    rows_max: int  # local rows, valid ones first
    hidden: int
    row_counts: tuple[int, ...]  # valid rows of every device of the axis
    norm: rmsnorm.NormConfig
    strategy: str  # "xla", "p2p", or CPU_P2P ("p2p" where lowered for CPU, else "xla")
    op_id: int
    timeout_ms: int

    @property
    def n_groups(self) -> int:
        return self.axis_size // self.group_size

    @property
    def rows(self) -> int:
        """R: rows gathered by each group (the same for all groups)."""
        return sum(self.row_counts[: self.group_size])

    @property
    def axis_index_groups(self) -> list[list[int]] | None:
        if self.group_size == self.axis_size:
            return None
        g = self.group_size
        return [list(range(k * g, (k + 1) * g)) for k in range(self.n_groups)]

    def group_row_index(self) -> np.ndarray:
        """``[n_groups, R]``: which rows of a group's padded gather ``[g * rows_max, H]`` are valid."""
        g, m = self.group_size, self.rows_max
        return np.array(
            [
                [k * m + l for k in range(g) for l in range(self.row_counts[grp * g + k])]
                for grp in range(self.n_groups)
            ],
            dtype=np.int32,
        ).reshape(self.n_groups, self.rows)


# ------------------------------------------------------------------------------------------------
# validation (errors name the argument, the value and the rule)


@dataclasses.dataclass(frozen=True)
class _Options:
    """The validated keyword arguments of one fused call, shared by the per-device and the
    global form (static, hashable). ``strategy`` is as asked (``"auto"`` included) until the
    global form resolves it for its mesh."""

    norm: rmsnorm.NormConfig
    group_size: int
    row_counts: tuple[int, ...]
    strategy: str
    timeout_ms: int


def _options(
    n: int,
    rows_max: int,
    axis,
    *,
    eps,
    weight_offset,
    group_size,
    row_counts,
    quantize_from,
    columnwise,
    strategy,
    scale_rule,
    p2p_timeout_s,
) -> _Options:
    """Every keyword argument checked once, for ``n`` devices of ``axis`` holding ``rows_max``
    local rows each."""
    norm = rmsnorm.norm_config(eps, weight_offset, quantize_from, columnwise, scale_rule)
    g = _check_group_size(group_size, n, axis)
    counts = _check_row_counts(row_counts, n, rows_max, g, axis)
    rmsnorm.check_columnwise_rows(norm, sum(counts[:g]))
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}")
    return _Options(norm, g, counts, strategy, _p2p_timeout_ms(p2p_timeout_s))


def _check_group_size(group_size, n: int, axis) -> int:
    if group_size is None:
        return n
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise TypeError(f"group_size={group_size!r} must be an int or None")
    if group_size < 1 or n % group_size:
        raise ValueError(
            f"group_size={group_size} must divide the size {n} of axis {axis!r} "
            f"(groups are contiguous runs of group_size devices)"
        )
    return int(group_size)


def _check_row_counts(row_counts, n: int, rows_max: int, group_size: int, axis) -> tuple[int, ...]:
    if row_counts is None:
        return (rows_max,) * n
    counts = (
        tuple(np.asarray(row_counts).reshape(-1).tolist())
        if not isinstance(row_counts, (tuple, list))
        else tuple(row_counts)
    )
    if len(counts) != n:
        raise ValueError(
            f"row_counts={counts} has {len(counts)} entries; it needs one per device of axis {axis!r} ({n})"
        )
    for k, c in enumerate(counts):
        if isinstance(c, bool) or not isinstance(c, numbers.Integral):
            raise TypeError(f"row_counts[{k}]={c!r} must be an int")
        if not 0 <= c <= rows_max:
            raise ValueError(
                f"row_counts[{k}]={c} does not fit: each device holds {rows_max} (padded) local "
                f"rows, so a count must be in [0, {rows_max}]"
            )
    counts = tuple(int(c) for c in counts)
    totals = [sum(counts[g : g + group_size]) for g in range(0, n, group_size)]
    if len(set(totals)) > 1:
        raise ValueError(
            f"row_counts={counts} give groups of {group_size} devices the row totals {totals}; "
            f"every group must gather the same number of rows (the outputs have one shape)"
        )
    return counts


# The kernels' ``timeout_ms`` attribute: 0 means no deadline, and so does any bound the clock
# cannot hold (rendezvous.h, timeout_from_ms); larger values are sent as the int64 maximum.
_NO_DEADLINE_MS = 0
_MAX_TIMEOUT_MS = np.iinfo(np.int64).max


def _p2p_timeout_ms(p2p_timeout_s) -> int:
    """``p2p_timeout_s`` (seconds; ``None`` or ``inf``: no deadline) as the kernel's
    ``timeout_ms``: at least 1 ms, saturating at the int64 maximum (itself no deadline)."""
    if p2p_timeout_s is None:
        return _NO_DEADLINE_MS
    if isinstance(p2p_timeout_s, bool) or not isinstance(p2p_timeout_s, numbers.Real) or not p2p_timeout_s > 0:
        raise ValueError(
            f"p2p_timeout_s={p2p_timeout_s!r} must be a positive number of seconds, or None (or inf) for no deadline"
        )
    if math.isinf(p2p_timeout_s):
        return _NO_DEADLINE_MS
    return max(1, min(_MAX_TIMEOUT_MS, round(float(p2p_timeout_s) * 1000)))


class ExperimentalGpuP2PWarning(UserWarning):
    """Issued once when ``strategy="p2p"`` is asked for on a GPU, an experimental path (see
    docs/limits.md)."""


_warned_gpu_p2p = False


def _warn_gpu_p2p(platform: str) -> None:
    global _warned_gpu_p2p
    if _warned_gpu_p2p:
        return
    _warned_gpu_p2p = True
    warnings.warn(
        f"strategy='p2p' on {platform} is experimental: the in-process GPU gather (peer access, "
        f"events, a blocking host rendezvous) is untested on multi-GPU hardware. "
        f"strategy='xla' is the tested path on GPUs.",
        ExperimentalGpuP2PWarning,
        stacklevel=4,
    )


def _resolve_strategy(strategy: str, platform: str | None, devices_here: bool, axis) -> str:
    """``"auto"`` -> ``"p2p"`` on CPU with every device of the axis in this process, else "xla".

    ``platform`` is the program's platform (``platforms.of_device``; jax's ``"gpu"`` is taken
    too), or None where only the lowering knows it (the per-device op): ``"auto"`` is then
    ``CPU_P2P``, resolved when the program is lowered.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {STRATEGIES}")
    if strategy == "auto":
        ok = platform in ("cpu", None) and devices_here and _ffi.has_target(_P2P_TARGET, "cpu")
        return ("p2p" if platform == "cpu" else CPU_P2P) if ok else "xla"
    if platform is None:
        platform = _ffi.default_platform()
    if strategy == "p2p":
        if not devices_here:
            raise ValueError(
                f"strategy='p2p' needs every device of axis {axis!r} in this process (the devices "
                f"meet in process memory); use strategy='xla' across processes"
            )
        kernel_platform = _ffi.extension_platform(platform)
        _ffi.require(_P2P_TARGET, kernel_platform)
        if kernel_platform in ("cuda", "rocm"):
            _warn_gpu_p2p(kernel_platform)
    return strategy


# ------------------------------------------------------------------------------------------------
# the gather, per device


def _gather_rows(x, cfg: _GatherConfig):
    """The group's valid rows ``[R, H]`` via ``lax.all_gather`` (linear in x; bf16 rows move as
    their bits, fp32 ones, the VJP's, as floats)."""
    xg = spmd.all_gather_bits(x, cfg.axis_name, axis=0, axis_index_groups=cfg.axis_index_groups)
    if cfg.rows == cfg.group_size * cfg.rows_max:
        return xg
    index = cfg.group_row_index()
    if (index == index[0]).all():  # every group has the same ragged pattern: a static take
        return jnp.take(xg, jnp.asarray(index[0]), axis=0)
    group = jax.lax.axis_index(cfg.axis_name) // cfg.group_size
    return jnp.take(xg, jnp.asarray(index)[group], axis=0)


def _other_mesh_axes(axis_name) -> tuple[list[tuple[str, int]], list[str]]:
    """The other axes of the mesh this code runs under: (manual ones with sizes, non-manual ones).

    A device's position along the other manual axes tells apart groups that share their index
    along ``axis_name`` (e.g. the dp rows of a (dp, tp) mesh gathering over tp).
    """
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    mesh = get() if get is not None else None
    if mesh is None or not mesh.axis_names:  # e.g. under pmap: only axis_name is known
        return [], []
    manual = set(getattr(mesh, "manual_axes", mesh.axis_names))
    others = [(a, s) for a, s in zip(mesh.axis_names, mesh.axis_sizes) if a != axis_name]
    return [(a, s) for a, s in others if a in manual], [a for a, s in others if a not in manual and s > 1]


def _where(cfg: _GatherConfig):
    """``(rank within the group, group along the axis, rendezvous id)``, as the p2p kernel takes
    them; the rendezvous id numbers every group of the whole mesh."""
    idx = jax.lax.axis_index(cfg.axis_name).astype(jnp.int32)
    group = idx // cfg.group_size
    key, stride = group, cfg.n_groups
    for name, size in _other_mesh_axes(cfg.axis_name)[0]:
        key = key + jax.lax.axis_index(name).astype(jnp.int32) * stride
        stride *= size
    return jnp.stack([idx % cfg.group_size, group, key])


def _fused_forward(x, gamma, cfg: _GatherConfig):
    if cfg.strategy == CPU_P2P:  # the lowering platform decides
        p2p, xla = (dataclasses.replace(cfg, strategy=s) for s in ("p2p", "xla"))
        axes = vma.union(x, gamma) | ({cfg.axis_name} if vma.tracked(cfg.axis_name) else set())
        typed = lambda c: lambda x, g: vma.vary_tree(_fused_forward(x, g, c), axes)
        return lax.platform_dependent(x, gamma, cpu=typed(p2p), default=typed(xla))
    n = cfg.norm
    if cfg.strategy == "p2p":
        normed, rq, rs, cq, cs, residual = ffi_calls.allgather_rmsnorm_quantize(
            x,
            gamma,
            _where(cfg),
            rows=cfg.rows,
            op_id=cfg.op_id,
            group_size=cfg.group_size,
            row_counts=cfg.row_counts,
            eps=n.eps,
            weight_offset=n.weight_offset,
            quantize_from_fp32=n.quantize_from_fp32,
            columnwise=n.columnwise,
            scale_rule=n.rule.code,
            timeout_ms=cfg.timeout_ms,
        )
        out = (normed, rq, rs, cq, cs, residual)
        # the results differ between groups (and gammas): say so to shard_map's checker
        axes = vma.union(x, gamma) | ({cfg.axis_name} if vma.tracked(cfg.axis_name) else set())
        return tuple(None if o is None else vma.vary(o, axes) for o in out)
    residual = _gather_rows(x, cfg)
    return rmsnorm.norm_quant(residual, gamma, n, "auto") + (residual,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fused(x, gamma, cfg: _GatherConfig):
    return _fused_forward(x, gamma, cfg)


def _fused_fwd(x, gamma, cfg):
    out = _fused_forward(x, gamma, cfg)
    # the residual output is the gathered x; x[:0] keeps only x's type (its varying axes)
    return out, (out[-1], gamma, x[:0])


def _fused_bwd(cfg: _GatherConfig, res, cts):
    residual, gamma, x_type = res
    f32 = jnp.float32
    d_normed, d_residual = cts[0], cts[-1]
    dx_rows, d_gamma = rmsnorm.vjp(residual, gamma, rmsnorm.cotangent(d_normed, residual), cfg.norm)
    dx_rows = dx_rows + rmsnorm.cotangent(d_residual, residual)
    # The transpose of the gather: a reduce-scatter over the group (scatter-add of ragged rows),
    # taken at a zero x of x's type so that shard_map's checker sees the types of the forward.
    x_zero = jnp.zeros((cfg.rows_max, cfg.hidden), f32) + jnp.sum(x_type.astype(f32))
    gathered, gather_vjp = jax.vjp(functools.partial(_gather_rows, cfg=cfg), x_zero)
    (dx,) = gather_vjp(vma.cotangent_like(dx_rows, gathered))
    dx = vma.cotangent_like(dx, x_type)
    d_gamma = vma.cotangent_like(d_gamma, gamma)
    return dx.astype(jnp.bfloat16), d_gamma.astype(gamma.dtype)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _empty_outputs(r: int, h: int, norm: rmsnorm.NormConfig):
    out = (
        jnp.zeros((r, h), jnp.bfloat16),
        jnp.zeros((r, h), jnp.float8_e4m3fn),
        jnp.zeros((r, h // fmt.BLOCK), jnp.uint8),
        jnp.zeros((r, h), jnp.float8_e4m3fn) if norm.columnwise else None,
        jnp.zeros((r // fmt.BLOCK, h), jnp.uint8) if norm.columnwise else None,
        jnp.zeros((r, h), jnp.bfloat16),
    )
    return out


def _public_order(out, norm: rmsnorm.NormConfig):
    normed, q, s, cq, cs, residual = out
    return (normed, q, s, residual, cq, cs) if norm.columnwise else (normed, q, s, residual)


def allgather_rmsnorm_quant_local(
    x: jax.Array,
    gamma: jax.Array,
    *,
    axis_name: str,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    group_size: int | None = None,
    row_counts: Sequence[int] | None = None,
    quantize_from: str = "normed",
    columnwise: bool = False,
    strategy: str = "auto",
    scale_rule: str = "rceil",
    p2p_timeout_s: float | None = DEFAULT_P2P_TIMEOUT_S,
    grouped: bool = False,
) -> tuple[jax.Array, ...]:
    """The fused op as one device sees it, for use inside ``jax.shard_map`` over ``axis_name``.

    ``x [rows_max, H]`` bf16 are this device's rows (valid rows first, padded to the largest
    count when ``row_counts`` is given); ``gamma [H]`` bf16 is this device's gamma. Returns
    ``(normed, quant, scales, residual)`` for the ``R`` rows gathered by this device's group
    (``R = sum of the group's row_counts``), plus ``(columnwise_quant, columnwise_scales)`` when
    ``columnwise=True``. Groups are contiguous runs of ``group_size`` devices along the axis.

    ``strategy="auto"`` takes ``"p2p"`` on CPU in a single-process run and ``"xla"`` otherwise;
    an explicit ``"p2p"`` on GPUs is experimental (see the module docstring).
    The outputs vary along ``axis_name`` (equal within a group, not across groups).

    Args:
      x: bf16 ``[rows_max, H]``, this device's rows: on device ``k`` of the axis the first
        ``row_counts[k]`` are valid, the rest padding.
      gamma: bf16 ``[H]``, this device's gamma.
      axis_name: the axis of the enclosing ``shard_map`` to gather over (``n`` devices).
      eps, weight_offset, quantize_from, scale_rule: the norm and quantize, as ``rmsnorm_quant``.
      group_size: gather within contiguous groups of this many devices (default: all ``n``).
      row_counts: the valid rows of every device of the axis (default: ``rows_max`` each); every
        group must gather the same total ``R``.
      columnwise: also make the columnwise planes (``R`` a multiple of 32).
      strategy: ``"auto"``, ``"xla"`` or ``"p2p"``; ``"p2p"`` needs a single-process run and every
        other axis of the mesh manual in the ``shard_map``.
      p2p_timeout_s: how long a ``"p2p"`` device waits for its peers (``None``: no deadline).
      grouped: return every output as ``[group_size, rows_max, ...]`` (group member, then its
        rows) instead of ``[group_size * rows_max, ...]``: the same bytes. Inside a
        ``shard_map`` that leaves other mesh axes automatic with ``x``'s rows sharded over them
        (an FSDP step under tensor parallelism), a flat output would interleave the members'
        rows with that sharding, which XLA can only honour by moving the rows between devices;
        grouped outputs keep it. Needs equal row counts (and ``rows_max`` a multiple of 32 with
        ``columnwise``).

    Returns:
      ``(normed [R, H] bf16, quant [R, H] e4m3, scales [R, H/32] uint8, residual [R, H] bf16)``,
      plus ``(columnwise_quant [R, H], columnwise_scales [R/32, H])`` when ``columnwise=True``;
      ``residual`` is the group's gathered valid rows of ``x``. With ``grouped``, each
      ``[R, ...]`` is ``[group_size, rows_max, ...]``.
    """
    rows_max, h = rmsnorm.check_rows(x)
    rmsnorm.check_gamma(gamma, h, ((h,),))
    n = int(jax.lax.axis_size(axis_name))
    opts = _options(
        n,
        rows_max,
        axis_name,
        eps=eps,
        weight_offset=weight_offset,
        group_size=group_size,
        row_counts=row_counts,
        quantize_from=quantize_from,
        columnwise=columnwise,
        strategy=strategy,
        scale_rule=scale_rule,
        p2p_timeout_s=p2p_timeout_s,
    )
    if not isinstance(grouped, bool):
        raise TypeError(f"grouped={grouped!r} must be True or False")
    if grouped:
        if any(c != rows_max for c in opts.row_counts):
            raise ValueError(
                f"grouped=True needs every device's row count equal to rows_max={rows_max}; "
                f"got row_counts={opts.row_counts}"
            )
        if columnwise and rows_max % fmt.BLOCK:
            raise ValueError(
                f"grouped=True with columnwise=True needs rows_max a multiple of {fmt.BLOCK} (each member's "
                f"columnwise scales whole 32-row blocks); got rows_max={rows_max}"
            )
    return _local(x, gamma, axis_name, opts, grouped=grouped)


def _local(x, gamma, axis_name: str, opts: _Options, *, grouped: bool = False) -> tuple[jax.Array, ...]:
    """The per-device op on checked ``x``, ``gamma`` and options (``grouped``: outputs
    ``[group_size, rows, ...]``)."""
    rows_max, h = x.shape
    n = int(jax.lax.axis_size(axis_name))
    unmapped = _other_mesh_axes(axis_name)[1]
    if unmapped and opts.strategy != "xla" and (out := _manual_over(unmapped, x, gamma, axis_name, opts)) is not None:
        return out if grouped else tuple(o.reshape(-1, o.shape[-1]) for o in out)
    if grouped:
        return tuple(o.reshape(opts.group_size, -1, o.shape[-1]) for o in _local(x, gamma, axis_name, opts))
    if unmapped and opts.strategy == "p2p":
        raise ValueError(
            f"strategy='p2p' cannot tell apart the groups of axis {axis_name!r} repeated along "
            f"the mesh axes {unmapped}, which are not manual in this shard_map; map them too "
            f"(shard_map axis_names) or use strategy='xla'"
        )
    here = jax.process_count() == 1 and not unmapped
    strategy = _resolve_strategy(opts.strategy, None, here, axis_name)
    norm = opts.norm
    cfg = _GatherConfig(
        axis_name=axis_name,
        axis_size=n,
        group_size=opts.group_size,
        rows_max=rows_max,
        hidden=h,
        row_counts=opts.row_counts,
        norm=norm,
        strategy=strategy,
        op_id=next(_op_ids) if strategy in ("p2p", CPU_P2P) else 0,
        timeout_ms=opts.timeout_ms,
    )
    if cfg.rows == 0:  # nothing to gather: no collective at all
        return _public_order(_empty_outputs(0, h, norm), norm)
    return _public_order(_fused(x, gamma, cfg), norm)


def _manual_over(unmapped: list[str], x, gamma, axis_name: str, opts: _Options):
    """The op inside a ``shard_map`` manual over the mesh axes the caller left automatic (an FSDP
    step under tensor parallelism is manual over tp only): ``x``'s rows split over them, each
    device gathering its part of every row block of its group, so that ``"p2p"`` can run. The
    outputs are ``[group member, row, ...]``, byte for byte what the op gives on the automatic
    axes (flattened, the members' rows would interleave the automatic axes' row split). None
    where that cannot be: rows the automatic axes do not divide, ragged row counts, columnwise
    blocks across a device's rows, several processes."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    split = math.prod(sizes[a] for a in unmapped)
    rows_max, _ = x.shape
    uniform = all(c == rows_max for c in opts.row_counts)
    if jax.process_count() != 1 or not uniform or rows_max % split:
        return None
    local = rows_max // split
    if opts.norm.columnwise and (local % fmt.BLOCK):
        return None
    entry = spmd.axis_group([a for a in mesh.axis_names if a in unmapped])
    inner = dataclasses.replace(opts, row_counts=(local,) * len(opts.row_counts))
    g = opts.group_size

    def body(xl, gl):
        out = _local(xl, gl, axis_name, inner)
        return tuple(o.reshape(g, -1, o.shape[-1]) for o in out)

    n_out = 6 if opts.norm.columnwise else 4
    spec = P(None, entry, None)
    out = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(entry, None), P()),
        out_specs=(spec,) * n_out,
        axis_names=set(unmapped),
        check_vma=False,
    )(x, gamma)
    return out


# ------------------------------------------------------------------------------------------------
# the global wrapper


def allgather_rmsnorm_quant(
    x: jax.Array,
    gamma: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    group_size: int | None = None,
    row_counts: Sequence[int] | None = None,
    quantize_from: str = "normed",
    columnwise: bool = False,
    strategy: str = "auto",
    scale_rule: str = "rceil",
    p2p_timeout_s: float | None = DEFAULT_P2P_TIMEOUT_S,
) -> tuple[jax.Array, ...]:
    """All-gather + RMSNorm + MXFP8 quantize of ``x`` over mesh axis ``axis`` (docs/design.md §5),
    byte-identical to gathering, then ``rmsnorm_quant``.

    Args:
      x: bf16 ``[n * rows_max, H]``, row-sharded along ``axis`` (device ``k`` of the axis holds
        rows ``[k * rows_max, (k+1) * rows_max)``, its first ``row_counts[k]`` valid).
      gamma: bf16 ``[H]`` (shared) or ``[n, H]`` (device ``k`` uses row ``k``).
      mesh, axis: the mesh and the name of the axis to gather over (``n`` devices).
      eps, weight_offset, quantize_from, scale_rule: the norm and quantize, as ``rmsnorm_quant``.
      group_size: gather within contiguous groups of this many devices (default: all ``n``).
      row_counts: the valid rows of every device of the axis (default: ``rows_max`` each); every
        group must gather the same total ``R``.
      columnwise: also make the columnwise planes (``R`` a multiple of 32).
      strategy: ``"auto"`` takes ``"p2p"`` when the mesh is on CPU with every device of the axis
        in this process, ``"xla"`` otherwise (always on GPUs, where an explicit ``"p2p"`` is
        experimental: see the module docstring).
      p2p_timeout_s: how long a ``"p2p"`` device waits for its peers (``None``: no deadline).

    Returns:
      ``(normed, quant, scales, residual)``, plus ``(columnwise_quant, columnwise_scales)`` when
      ``columnwise=True``. With one group and a shared gamma they are the ``[R, ...]`` gathered
      results, replicated. With several groups, or per-device gammas, devices' results differ,
      so the outputs stack every device's copy along ``axis``: ``[n * R, ...]``, device ``k``'s
      rows ``[k * R, (k+1) * R)``.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    n = mesh.shape[axis]
    rows, h = rmsnorm.check_rows(x)
    if rows % n:
        raise ValueError(
            f"x has {rows} rows, which the {n} devices of axis {axis!r} cannot split evenly; "
            f"pad every device's shard to the same row count and pass row_counts"
        )
    rmsnorm.check_gamma(gamma, h, ((h,), (n, h)))
    # Validated here, before tracing, so errors do not surface from inside shard_map.
    opts = _options(
        n,
        rows // n,
        axis,
        eps=eps,
        weight_offset=weight_offset,
        group_size=group_size,
        row_counts=row_counts,
        quantize_from=quantize_from,
        columnwise=columnwise,
        strategy=strategy,
        scale_rule=scale_rule,
        p2p_timeout_s=p2p_timeout_s,
    )
    devices = mesh.devices.reshape(-1)
    here = all(d.process_index == jax.process_index() for d in devices)
    platform = platforms.of_device(devices[0])
    opts = dataclasses.replace(opts, strategy=_resolve_strategy(opts.strategy, platform, here, axis))
    spec = _GlobalSpec(mesh=mesh, axis=axis, hidden=h, per_device_gamma=gamma.ndim == 2, options=opts)
    if is_traced(x, gamma):
        # Inside the caller's trace: a fresh function, so this call site gets its own op id
        # even when the same call is made many times in one program.
        return _global_fn(spec)(x, gamma)
    return _global_jit(spec)(x, gamma)


@dataclasses.dataclass(frozen=True)
class _GlobalSpec:
    mesh: Mesh
    axis: str
    hidden: int
    per_device_gamma: bool
    options: _Options  # checked, the strategy resolved for the mesh


def _global_fn(spec: _GlobalSpec):
    opts = spec.options
    n = spec.mesh.shape[spec.axis]
    h = spec.hidden

    def local(xl, gl):
        gl = gl.reshape(h) if spec.per_device_gamma else gl
        return _local(xl, gl, spec.axis, opts)

    replicated = opts.group_size == n and not spec.per_device_gamma
    out_spec = P() if replicated else P(spec.axis)
    n_out = 6 if opts.norm.columnwise else 4
    return spmd.shard_map(
        local,
        spec.mesh,
        in_specs=(P(spec.axis), P(spec.axis) if spec.per_device_gamma else P()),
        out_specs=(out_spec,) * n_out,
    )


@functools.lru_cache(maxsize=128)
def _global_jit(spec: _GlobalSpec):
    """Eager calls: one compiled program per configuration (each execution has its own RunId,
    so reusing the op id across calls is safe)."""
    return jax.jit(_global_fn(spec))
