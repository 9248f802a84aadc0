"""One FSDP unit inside a training step: a weight's local shards, gathered just in time.

A unit is a parameter that the loss contracts in GEMMs or reads by lookups (``fsdp_trace``),
whatever layer holds it. Its GEMM geometry comes from the contraction: ``K`` is the product of
the parameter axes its GEMMs contract, ``N`` of the axes they keep, and the axes they batch
over (an MoE's experts) are stack axes, like the layer axis that ``nnx.vmap`` stacks and
``nnx.scan`` slices. Each device stores its rows of ``W [*stack, N, K]`` (the parameter's axes
moved to ``stack, N, K`` and merged; Transformer Engine's ``[out, in]`` for a Linear kernel):

    master      fp32        [*stack, rows, K]         rows = N_padded / n
    rowwise     E4M3 codes  [*stack, rows, K]         E8M0 scales [*stack, rows, K/32]
    columnwise  E4M3 codes  [*stack, rows, K]         E8M0 scales [*stack, rows/32, K]

An MXFP8 unit's rows are whole 32-row blocks on every device (``N_padded`` a multiple of
``32 n``), so quantizing a shard equals quantizing the whole weight; a bf16 unit stores the
master only, rows padded to a multiple of ``n``.

Every op of the loss that reads a unit runs as ONE ``custom_vjp`` over the local shards
(``unit_gemm``, ``unit_lookup``):

    forward   all-gather the planes blocked along the op's contraction (a GEMM contracting K:
              the rowwise planes; one contracting N, the transposed use of a tied weight: the
              columnwise), dequantize exactly, rebuild the value the layer saw (its reshapes,
              transposes and casts replayed) and run the op as written; save the activation
              and the LOCAL planes of the other direction: no gathered weight outlives the op
    backward  all-gather the other planes for the dgrad; dW in fp32 leaves through one
              reduce-scatter into this device's master rows (a lookup: the scattered rows)

A gather waits for the op's activation (forward) or cotangent (backward) by a data dependency
(``after``), so in a Python loop over layers each unit is gathered when its layer runs, not at
the start of the step. ``precision="bf16"`` units are the same with the master rows rounded to
bf16 and gathered as 16-bit words, once for the forward and once for the backward.

By default (``gemm="dequantized"``) the gathered planes are dequantized (exact) and the GEMMs
run on the values as the layer wrote them: the forward is the layer's own ``dot_general``
(its 16-bit operands multiplied as fp32 where lowered for CPUs: the same numbers); the
dgrad and wgrad (``Gemms.backward``) take the forward's operand dtype (bf16) with fp32
accumulation where the step is lowered for GPUs, as XLA's own backward does, and fp32
operands where it is lowered for CPUs (products of bf16 and dequantized MXFP8 values are
exact in fp32: the exact path the tests compare with). With
``gemm="mxfp8"`` an MXFP8 unit's GEMM is ``_mx_gemm``: the layer's ``dot_general`` rewritten as
the canonical block-scaled product (``_Canonical``), forward, dgrad and wgrad on E4M3 operands
(``mxfp8_gemm``), the gathered planes as the weight operands. Quantization is the identity for
the gradient (straight-through).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from mxfp8_jax._src.core import spmd
from mxfp8_jax._src.fsdp.fsdp_dots import backward_dots, forward_dot
from mxfp8_jax._src.fsdp.fsdp_geometry import Gemms, UnitGeometry
from mxfp8_jax._src.fsdp.fsdp_planes import Plane, UnitShards, decode, direction
from mxfp8_jax._src.fsdp.fsdp_trace import P, product
from mxfp8_jax._src.numerics.format import BLOCK
from mxfp8_jax._src.ops import mxfp8_gemm

# ------------------------------------------------------------------------------------------------
# One op reading a unit


@dataclasses.dataclass(frozen=True, eq=False)
class UnitOp:
    """Static description of one op of the loss that reads a unit (hashed by identity).

    ``ops``: the layout ops ``(primitive, params)`` between the parameter and the op, replayed
    on the gathered weight; ``prim``/``params``: the op itself (``dot_general``, ``gather``,
    ``dynamic_slice``), the unit its operand ``position``; ``transposed``: a GEMM contracting
    the unit's N axes (its forward reads the columnwise planes); ``picked``: the sizes of the
    leading layer axes of the shards it is given, of which it reads one index each (``w[i]``
    of a stack: the op picks the layer from the stacked shards itself, so the backward keeps
    the stack, not a per-layer copy of its planes); ``early``: a layer a loop reads per
    iteration under ``prefetch``: its backward gathers wait for nothing, so that they too may
    run beside the iteration's GEMMs or a pipeliner move them an iteration ahead; ``reuses``:
    its forward takes fetched bytes its dgrad reads too (a 32x32 plane, a bf16 weight) inside
    an iteration its backward recomputes, so the backward keeps them instead of gathering them
    again (kept from the recompute to the dgrad of one iteration, not across the step).
    """

    geometry: UnitGeometry
    param_dtype: Any
    ops: tuple
    prim: Any
    params: dict
    position: int
    transposed: bool = False
    gemm: Gemms = dataclasses.field(default_factory=Gemms)  # how its GEMMs multiply
    picked: tuple[int, ...] = ()  # sizes of the leading layer axes it reads one index of
    early: bool = False  # a loop's per-iteration layer: its backward gathers wait for nothing
    reuses: bool = False  # the dgrad reads the fetched bytes the forward took

    def value(self, w: jax.Array) -> jax.Array:
        """``W [*batch, N, K]`` (gathered) -> the operand as the layer's op sees it."""
        v = self.geometry.from_master(w.astype(self.param_dtype), self.geometry.level)
        for prim, params in self.ops:
            v = prim.bind(v, **params)
        return v

    def layout(self, v: jax.Array) -> jax.Array:
        """The layout ops alone (casts left out), for carrying fp32 gradients back."""
        for prim, params in self.ops:
            if prim is not P.convert_element_type_p:
                v = prim.bind(v, **params)
        return v

    def bind(self, unit_operand, others: tuple) -> jax.Array:
        operands = list(others)
        operands.insert(self.position, unit_operand)
        return self.prim.bind(*operands, **self.params)


OWN = "own"  # a gather waits for the op's own input (``unit_gemm``'s ``token``)


@dataclasses.dataclass(frozen=True, eq=False)
class Handoff:
    """An op's part in the backward's handoff: the unit GEMMs of a Python loop's layers, linked
    in program order (``fsdp_eval``), each gather their predecessor's backward weight.

    ``gives``: the op also returns a zero ``handoff`` value, shaped as its gathered backward
    weight (float bits of its planes); where the next op reads it, its cotangent IS that weight,
    which the op's backward then takes instead of gathering (a symbolic zero cotangent, where
    nothing read it: it gathers its own). ``takes``: the op before (its ``UnitOp``), whose
    backward weight this op's backward gathers, once its own cotangent exists, and returns as
    the cotangent of the handoff it read. So an op's backward gather runs beside the GEMMs of
    the op after it in the forward (before it in the backward), as FSDP's backward prefetch."""

    gives: bool = False
    takes: UnitOp | None = None


NO_HANDOFF = Handoff()


def unit_gemm(
    op: UnitOp,
    act: jax.Array,
    shards: UnitShards,
    given=None,
    pick: tuple = (),
    token=OWN,
    fetched=None,
    handoff: Handoff = NO_HANDOFF,
    handed=None,
    before=None,
):
    """The ``dot_general`` of ``op`` with the unit as one operand and ``act`` the other, run on
    this device's ``shards`` (its master rows and planes): one ``custom_vjp``. ``given``: the
    MXFP8 planes of ``act`` when it is one (``mxfp8_gemm.GivenOperand``), used by MXFP8 GEMMs
    whose activation is the marked value itself, rows by tokens and K last. ``pick``: one
    int32 index per axis of ``op.picked`` (the layer the op reads of stacked shards).
    ``token``: what the forward gather waits for: ``OWN`` (the op's input), another array (the
    input of an earlier layer: the gather runs while the layers between compute), or None
    (nothing: inside a loop, the gather of the iteration's own slice). ``fetched``: the weight
    as ``fetch`` gathered it earlier (a loop's next layer, gathered in the iteration before),
    used instead of a gather of its own. ``handoff`` (``Handoff``): ``handed``, the value the op
    before returned, and ``before``, that op's ``(shards, pick)``; with ``handoff.gives`` the
    result is ``(y, handoff value)``."""
    pick = tuple(jnp.asarray(i, jnp.int32) for i in pick)
    token = act if token is OWN else token
    if handoff.gives or handoff.takes is not None:
        before = None if before is None else (lax.stop_gradient(before[0].master), before[0].planes, before[1])
        return _handed_gemm(op, handoff, act, shards.master, shards.planes, pick, token, fetched, handed, before)
    if op.gemm.mxfp8 is not None and op.geometry.precision == "mxfp8":
        canon = _Canonical.of(op, act)
        if given is not None and not canon.takes(given, act):
            given = None
        order = None if given is None else given.order
        arrays = None if given is None else given.arrays
        return _mx_gemm(op, canon, order, act, shards.master, shards.planes, arrays, pick, token, fetched)
    return _gemm(op, act, shards.master, shards.planes, pick, token, fetched)


def fetch(op: UnitOp, shards: UnitShards, pick: tuple, token=None) -> Any:
    """The bytes the forward of ``op`` gathers of the layer ``pick`` names of this device's
    stacked ``shards``, once ``token`` exists: its 8-bit planes (or bf16 weight) gathered whole,
    not yet widened. ``unit_gemm(..., fetched=...)`` takes them instead of gathering its own."""
    pick = tuple(jnp.asarray(i, jnp.int32) for i in pick)
    return _gather(op.geometry, after(_local(op, shards.master, shards.planes, backward=False, pick=pick), token))


def _forward_bytes(op: UnitOp, act, master, planes, pick, token, fetched):
    """What the forward of ``op`` widens, and what widening waits for: ``fetched`` where given
    (gathered earlier: it waits for ``act``), else this op's own gather after ``token``."""
    if fetched is not None:
        return fetched, act
    return fetch(op, UnitShards(master, planes), pick, token), _ready(act, token)


def unit_lookup(op: UnitOp, others: tuple, shards: UnitShards, pick: tuple = (), token=OWN) -> jax.Array:
    """A ``gather`` / ``dynamic_slice`` of the unit (``others``: its index operands), on this
    device's shards: the table gathered for the lookup, the gradient reduce-scattered.
    ``pick``, ``token``: as for ``unit_gemm`` (``OWN``: the first index operand)."""
    pick = tuple(jnp.asarray(i, jnp.int32) for i in pick)
    token = (others[0] if others else None) if token is OWN else token
    return _lookup(op, tuple(others), shards.master, shards.planes, pick, token)


def pick_layer(a: jax.Array, pick) -> jax.Array:
    """``a[pick]``: one index of each of ``a``'s leading ``len(pick)`` axes (static or traced,
    clamped as ``dynamic_slice`` clamps)."""
    for i in pick:
        a = lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False)
    return a


def _unpick(op: UnitOp, d_layer: jax.Array, pick) -> jax.Array:
    """The gradient of one picked layer's shards -> of the stacked shards (zero elsewhere)."""
    if not pick:
        return d_layer
    full = jnp.zeros((*op.picked, *d_layer.shape), d_layer.dtype)
    start = (*pick, *(jnp.zeros((), jnp.int32),) * d_layer.ndim)
    return lax.dynamic_update_slice(full, d_layer.reshape((1,) * len(pick) + d_layer.shape), start)


def _local(op: UnitOp, master, planes, *, backward: bool, pick=()):
    """The local shards a gather of ``op`` reads: MXFP8 planes blocked along its forward
    contraction (``backward``: the other direction), or the bf16 master; the layer ``pick``
    names when given (stacked shards otherwise)."""
    if op.geometry.precision != "mxfp8":
        return pick_layer(master, pick)
    rowwise = op.transposed == backward  # forward of a K-contracting GEMM: rowwise
    return jax.tree.map(lambda a: pick_layer(a, pick), planes.along(columnwise=not rowwise))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gemm(op: UnitOp, act, master, planes, pick, token, fetched):
    fetched, ready = _forward_bytes(op, act, master, planes, pick, token, fetched)
    w = widened(op.geometry, fetched, columnwise=op.transposed, ready=ready)
    return forward_dot(op, act, op.value(w))


def _gemm_fwd(op: UnitOp, act, master, planes, pick, token, fetched):
    y = _gemm(op, act, master, planes, pick, token, fetched)
    return y, (act, _kept(op, master, planes, fetched), pick)


def _gemm_bwd(op: UnitOp, residuals, dy):
    act, local, pick = residuals
    return *_gemm_grads(op, act, pick, dy, *_backward_bytes(op, local, pick, dy)), None, None, None, None


def _kept(op: UnitOp, master, planes, fetched):
    """What a unit GEMM's forward keeps for its backward weight: the local shards its backward
    gathers (stacked where the op picks a layer: the stack itself, not a copy of the layer), or
    with ``op.reuses`` the fetched plane itself."""
    return fetched if op.reuses else _local(op, master, planes, backward=True)


def _backward_bytes(op: UnitOp, local, pick, dy):
    """The op's own gather for its backward: ``(gathered bytes, what widening them waits for)``;
    with ``op.reuses``, ``local`` is the plane the forward took, not gathered again."""
    if op.reuses:
        return local, dy
    local = jax.tree.map(lambda p: pick_layer(p, pick), local)
    local = after(local, None if op.early else dy)  # the gather waits for the gradient that needs it
    return _gather(op.geometry, local), (dy if op.early else None)


def _gemm_grads(op: UnitOp, act, pick, dy, gathered_bytes, ready):
    """``(d act, d master rows)`` of ``_gemm`` from its gathered backward weight."""
    v = op.value(widened(op.geometry, gathered_bytes, columnwise=not op.transposed, ready=ready))
    d_act, d_v = backward_dots(op, act, v, dy)
    return d_act.astype(act.dtype), _unpick(op, _to_local_grad(op, d_v), pick)


_gemm.defvjp(_gemm_fwd, _gemm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _handed_gemm(op: UnitOp, handoff: Handoff, act, master, planes, pick, token, fetched, handed, before):
    """``_gemm`` in the handoff (``Handoff``): the same forward and gradients, its backward
    weight handed over by the op after it, the op before's gathered for it."""
    y = _gemm(op, act, master, planes, pick, token, fetched)
    return (y, _zero_handoff(op, master, planes, pick)) if handoff.gives else y


def _handed_gemm_fwd(op: UnitOp, handoff: Handoff, *args):
    act, master, planes, pick, token, fetched, handed, before = jax.tree.map(
        lambda a: a.value, args, is_leaf=lambda a: isinstance(a, CustomVJPPrimal)
    )
    out = _handed_gemm(op, handoff, act, master, planes, pick, token, fetched, handed, before)
    return out, (act, _kept(op, master, planes, fetched), pick, before)


def _handed_gemm_bwd(op: UnitOp, handoff: Handoff, residuals, cts):
    act, local, pick, before = residuals
    dy, given = cts if handoff.gives else (cts, None)
    if isinstance(dy, SymbolicZero):
        dy = jnp.zeros(dy.shape, dy.dtype)
    zero = lambda a: isinstance(a, SymbolicZero)
    if given is None or any(zero(a) for a in jax.tree.leaves(given, is_leaf=zero)):  # not read: gather
        bytes_ready = _backward_bytes(op, local, pick, dy)
    else:
        # handed early as 8-bit planes: widened only once this op's own cotangent exists
        shapes = _gathered_shapes(op, local, pick)
        bytes_ready = jax.tree.map(lambda a, s: lax.bitcast_convert_type(a[0], s.dtype), given, shapes), dy
    d_act, d_master = _gemm_grads(op, act, pick, dy, *bytes_ready)
    d_handed = None
    if handoff.takes is not None:  # the op before's backward weight, once this cotangent exists
        master, planes, before_pick = before
        d_handed = handed_weight(handoff.takes, master, planes, before_pick, dy)
    return d_act, d_master, None, None, None, None, d_handed, None


_handed_gemm.defvjp(_handed_gemm_fwd, _handed_gemm_bwd, symbolic_zeros=True)


def _gathered_shapes(op: UnitOp, local, pick):
    """The shapes and dtypes of the op's gathered backward weight (``_gather``'s result) from
    its local backward shards ``local`` (stacked where ``pick`` picks a layer)."""
    local = jax.tree.map(lambda p: pick_layer(p, pick), local)
    return jax.eval_shape(lambda l: _gather(op.geometry, l), local)


def _zero_handoff(op: UnitOp, master, planes, pick):
    """The handoff value an op returns: zeros shaped as its encoded gathered backward weight,
    with a leading axis of 1 (the device's own copy)."""
    shapes = _gathered_shapes(op, _local(op, master, planes, backward=True), pick)
    return jax.tree.map(lambda a: jnp.zeros((1, *a.shape), _carrier(a.dtype)), shapes)


def handed_weight(op: UnitOp, master, planes, pick, token=None):
    """The backward weight of ``op`` (of the layer ``pick`` names of stacked shards) gathered
    whole once ``token`` exists, as a handoff's cotangent carries it (``encoded``)."""
    return encoded(_gather(op.geometry, after(_local(op, master, planes, backward=True, pick=pick), token)))


def _carrier(dtype):
    """The floating dtype of the same width that carries ``dtype``'s bits as a cotangent (an
    integer cotangent would be float0: no data)."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float8_e4m3fn) if dtype == jnp.uint8 else dtype


def encoded(gathered):
    """Gathered planes (or bf16 weight) as the handoff's cotangent: the same bits, floats (the
    receiving op bitcasts them back to its ``_gathered_shapes``)."""
    return jax.tree.map(
        lambda a: (lax.bitcast_convert_type(a, _carrier(a.dtype)) if _carrier(a.dtype) != a.dtype else a)[None],
        gathered,
    )


# ------------------------------------------------------------------------------------------------
# MXFP8 GEMMs (``FSDP(gemm="mxfp8")``)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _mx_gemm(op: UnitOp, canon: _Canonical, order, act, master, planes, given, pick, token, fetched):
    return _mx_gemm_fwd(op, canon, order, act, master, planes, given, pick, token, fetched)[0]


def _mx_gemm_fwd(op: UnitOp, canon: _Canonical, order, act, master, planes, given, pick, token, fetched):
    fetched, ready = _forward_bytes(op, act, master, planes, pick, token, fetched)
    w = _weight(op.geometry, fetched, ready, op.transposed)
    if given is None:
        y, x_col = mxfp8_gemm.forward(canon.act_to_x(act), w, op.gemm.mxfp8)
    else:  # x is MXFP8 already: its rowwise planes go into the GEMM as they are
        normed, codes, scales, cq, cs = given
        rows = lambda a: a.reshape(1, -1, a.shape[-1])
        y = mxfp8_gemm.scaled_matmul(
            rows(codes), rows(scales), *w, path=op.gemm.mxfp8.path, platform=op.gemm.mxfp8.platform
        )
        if cq is not None:  # and its columnwise planes are the wgrad's x
            x_col = mxfp8_gemm.Quantized(None, (rows(mxfp8_gemm.as_bytes(cq)), rows(cs)), canon.m)
        else:
            x_col = mxfp8_gemm.quantize_tokens(canon.act_to_x(normed), op.gemm.mxfp8.scale_rule, rowwise=False)
    # saved: x's columnwise planes (8.25 bits a value) and what the dgrad's weight comes from
    return canon.y_to_out(y), (x_col, _kept(op, master, planes, fetched), pick)


def _mx_gemm_bwd(op: UnitOp, canon: _Canonical, order, residuals, dy):
    x_col, local, pick = residuals
    w_t = _weight(op.geometry, *_backward_bytes(op, local, pick, dy), not op.transposed)
    dx, dv = mxfp8_gemm.backward(canon.out_to_y(dy), x_col, w_t, op.gemm.mxfp8, order=order)
    grads = _unpick(op, _scatter_rows(op.geometry, canon.v_to_w(dv)), pick)
    return canon.x_to_act(dx), grads, None, None, None, None, None


_mx_gemm.defvjp(_mx_gemm_fwd, _mx_gemm_bwd)


def _weight(g: UnitGeometry, fetched, ready, columnwise: bool) -> tuple[jax.Array, jax.Array]:
    """The gathered planes of one direction (``_gather``) as the block-scaled GEMM's weight
    operand: rowwise ``[B, N, K]`` blocked along K, columnwise ``[B, K, N]`` blocked along N (no
    dequantize). ``ready``: as for ``gathered``."""
    codes, scales = direction(Plane(*after(tuple(fetched), ready)), columnwise=columnwise, tiled=g.tiled)
    n, b = g.out_features, product(g.stack[g.level :])
    codes = codes[..., :n, :].reshape(b, n, g.in_features)
    scales = scales[..., : n // BLOCK, :] if columnwise else scales[..., :n, :]
    return mxfp8_gemm.weight_operand(codes, scales.reshape(b, -1, scales.shape[-1]), columnwise=columnwise)


def _scatter_rows(g: UnitGeometry, dw: jax.Array) -> jax.Array:
    """``dW [*batch, N, K]`` fp32 -> this device's rows (one reduce-scatter of the padded rows)."""
    pad = [(0, 0)] * (dw.ndim - 2) + [(0, g.out_padded - g.out_features), (0, 0)]
    dw = jnp.pad(dw, pad)
    return lax.psum_scatter(dw, g.axes, scatter_dimension=dw.ndim - 2, tiled=True)


_CANONICAL: dict = {}


@dataclasses.dataclass(frozen=True)
class _Canonical:
    """The layer's ``dot_general`` of ``act`` and the unit as the canonical GEMM
    ``y [B, M, D] = x [B, M, C] . V [B, D, C]^T``, where ``V`` is ``W [B, N, K]`` (C = K, D = N),
    or ``W^T`` for a GEMM contracting the unit's N axes (C = N, D = K).

    ``act_perm`` moves act's axes to (batch, free, contracting); ``pb``/``pd``/``pc`` say which
    index of ``W``'s batch / D / C each flattened dot axis holds (None: in order), found by
    replaying the layer's layout ops on the indices of ``W`` (a reshape or transpose of the
    kernel reorders them); ``y_perm`` puts the result in the dot's output order.
    """

    act_perm: tuple
    act_sizes: tuple
    act_dtype: Any
    out_sizes: tuple
    y_perm: tuple | None
    out_dtype: Any
    b: int
    m: int
    c: int
    d: int
    pb: tuple | None
    pd: tuple | None
    pc: tuple | None
    transposed: bool
    w_shape: tuple

    @classmethod
    def of(cls, op: UnitOp, act) -> _Canonical:
        key = (op.geometry, repr(op.ops), repr(op.params), op.position, op.transposed, act.shape, act.dtype)
        if key not in _CANONICAL:
            _CANONICAL[key] = cls._build(op, act)
        return _CANONICAL[key]

    @classmethod
    def _build(cls, op: UnitOp, act) -> _Canonical:
        g, pos = op.geometry, op.position
        (lc, rc), (lb, rb) = op.params["dimension_numbers"]
        cu, bu = (lc, lb) if pos == 0 else (rc, rb)
        ca, ba = (rc, rb) if pos == 0 else (lc, lb)
        batch = g.stack[g.level :]
        n, k, b = g.out_features, g.in_features, product(batch)
        with jax.ensure_compile_time_eval():
            idx = np.arange(b * n * k, dtype=np.int32).reshape(*batch, n, k)
            iv = np.asarray(op.layout(g.from_master(jnp.asarray(idx), g.level)))
        fu = [a for a in range(iv.ndim) if a not in cu and a not in bu]
        fa = [a for a in range(act.ndim) if a not in ca and a not in ba]
        size = lambda shape, axes: product([shape[a] for a in axes])
        v_shape = iv.shape
        bd, dd, cd = size(v_shape, bu), size(v_shape, fu), size(v_shape, cu)
        iv = iv.transpose([*bu, *fu, *cu]).reshape(bd, dd, cd)
        bi, ni, ki = iv // (n * k), (iv // k) % n, iv % k
        di, ci = (ki, ni) if op.transposed else (ni, ki)
        pb, pd, pc = bi[:, 0, 0], di[0, :, 0], ci[0, 0, :]
        separable = (
            (bd, dd, cd) == (b, *((k, n) if op.transposed else (n, k)))
            and (bi == pb[:, None, None]).all()
            and (di == pd[None, :, None]).all()
            and (ci == pc[None, None, :]).all()
        )
        if not separable:
            raise ValueError(
                f"gemm='mxfp8': the GEMM {op.params['dimension_numbers']} of a unit {g.param_shape} mixes its "
                f"kernel's axes across batch, kept and contracted roles after the layer's reshapes; "
                f"give this parameter precision 'bf16' (precision_by_path) or use gemm='dequantized'"
            )
        ident = lambda p: None if (p == np.arange(p.size)).all() else tuple(int(i) for i in p)
        act_perm = (*ba, *fa, *ca)
        if size(act.shape, ba) != b or size(act.shape, ca) != cd:
            raise ValueError(f"activation {act.shape} does not match the unit GEMM {op.params['dimension_numbers']}")
        nb, na, nu = len(ba), len(fa), len(fu)
        free_u = tuple(v_shape[a] for a in fu)
        out_sizes = (*(act.shape[a] for a in ba), *(act.shape[a] for a in fa), *free_u)
        y_perm = None  # the dot's output: batch, lhs free, rhs free
        if pos == 0:
            y_perm = (*range(nb), *range(nb + na, nb + na + nu), *range(nb, nb + na))
        v_aval = jax.ShapeDtypeStruct((*batch, n, k), jnp.float32)
        out = jax.eval_shape(
            lambda a, w: op.bind(op.value(w), (a,)), jax.ShapeDtypeStruct(act.shape, act.dtype), v_aval
        )
        return cls(
            act_perm=act_perm,
            act_sizes=tuple(act.shape[a] for a in act_perm),
            act_dtype=act.dtype,
            out_sizes=out_sizes,
            y_perm=y_perm,
            out_dtype=out.dtype,
            b=b,
            m=size(act.shape, fa),
            c=cd,
            d=dd,
            pb=ident(pb),
            pd=ident(pd),
            pc=ident(pc),
            transposed=op.transposed,
            w_shape=(*batch, n, k),
        )

    def takes(self, given, act) -> bool:
        """Whether ``given`` planes (of ``act`` as it is) can be this GEMM's x: tokens by rows,
        K last, in order, no batch axes."""
        codes = given.arrays[1]
        plain = self.act_perm == tuple(range(len(self.act_perm))) and self.b == 1 and self.pc is None
        return plain and tuple(codes.shape) == tuple(act.shape)

    def act_to_x(self, act: jax.Array) -> jax.Array:
        """The layer's activation -> ``x [B, M, C]``, C in ``W``'s order."""
        x = jnp.transpose(act, self.act_perm).reshape(self.b, self.m, self.c)
        x = x if self.pb is None else x[np.argsort(self.pb)]
        return x if self.pc is None else x[..., np.argsort(self.pc)]

    def x_to_act(self, dx: jax.Array) -> jax.Array:
        """``dx [B, M, C]`` fp32 -> the activation's cotangent (its layout and dtype)."""
        dx = dx if self.pc is None else dx[..., np.asarray(self.pc)]
        dx = dx if self.pb is None else dx[np.asarray(self.pb)]
        dx = dx.reshape(self.act_sizes).astype(self.act_dtype)
        return jnp.transpose(dx, np.argsort(self.act_perm))

    def y_to_out(self, y: jax.Array) -> jax.Array:
        """``y [B, M, D]`` fp32 -> the dot's output (its layout and dtype)."""
        y = y if self.pb is None else y[np.asarray(self.pb)]
        y = y if self.pd is None else y[..., np.asarray(self.pd)]
        y = y.reshape(self.out_sizes).astype(self.out_dtype)
        return y if self.y_perm is None else jnp.transpose(y, self.y_perm)

    def out_to_y(self, dy: jax.Array) -> jax.Array:
        """The output's cotangent -> ``dy [B, M, D]`` (its dtype kept: quantized next)."""
        dy = dy if self.y_perm is None else jnp.transpose(dy, np.argsort(self.y_perm))
        dy = dy.reshape(self.b, self.m, self.d)
        dy = dy if self.pb is None else dy[np.argsort(self.pb)]
        return dy if self.pd is None else dy[..., np.argsort(self.pd)]

    def v_to_w(self, dv: jax.Array) -> jax.Array:
        """The wgrad ``dV [B, D, C]`` -> ``dW [*batch, N, K]``."""
        dw = jnp.swapaxes(dv, 1, 2) if self.transposed else dv
        return dw.reshape(self.w_shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(op: UnitOp, others, master, planes, pick, token):
    local = after(_local(op, master, planes, backward=False, pick=pick), token)
    ready = _ready(others[0] if others else None, token)
    return op.bind(op.value(gathered(op.geometry, local, columnwise=False, ready=ready)), others)


def _lookup_fwd(op: UnitOp, others, master, planes, pick, token):
    return _lookup(op, others, master, planes, pick, token), (others, pick)


def _lookup_bwd(op: UnitOp, residuals, dy):
    others, pick = residuals
    shape = jax.ShapeDtypeStruct(_value_shape(op), jnp.float32)
    (d_v,) = jax.linear_transpose(lambda v: op.bind(v, others), shape)(dy.astype(jnp.float32))
    return None, _unpick(op, _to_local_grad(op, d_v), pick), None, None, None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def _value_shape(op: UnitOp) -> tuple[int, ...]:
    g = op.geometry
    w = jax.ShapeDtypeStruct((*g.stack[g.level :], g.out_features, g.in_features), jnp.float32)
    return jax.eval_shape(lambda w: op.layout(g.from_master(w, g.level)), w).shape


def _to_local_grad(op: UnitOp, d_v: jax.Array) -> jax.Array:
    """The fp32 cotangent of the op's operand -> this device's rows of ``dW`` (one
    reduce-scatter of the padded ``[*batch, N_padded, K]``)."""
    g = op.geometry
    param_shape = g.sliced_shape(g.level)
    (d_param,) = jax.linear_transpose(op.layout, jax.ShapeDtypeStruct(param_shape, jnp.float32))(d_v)
    dw = g.to_master(d_param, g.level)
    return lax.psum_scatter(dw, g.axes, scatter_dimension=dw.ndim - 2, tiled=True)


# ------------------------------------------------------------------------------------------------
# Gathers


def all_gather_rows(x: jax.Array, axes) -> jax.Array:
    """This device's rows ``[..., rows, K]`` -> every device's, in shard order (narrow floats as bits)."""
    return spmd.all_gather_bits(x, axes, axis=x.ndim - 2)


def gathered(g: UnitGeometry, local, *, columnwise: bool, ready=None) -> jax.Array:
    """``W [*batch, N, K]`` from this device's shards: the MXFP8 planes of one direction
    dequantized exactly to fp32, or the master rows rounded to bf16. ``ready``: what the
    gathered bytes wait for before they are widened (the op's own input when the gather was
    started earlier: the early gather holds 8-bit planes, not fp32 weights)."""
    return widened(g, _gather(g, local), columnwise=columnwise, ready=ready)


def _gather(g: UnitGeometry, local):
    """This device's ``local`` shards (``_local``) gathered whole: the 8-bit planes, or the
    master rows as bf16."""
    if g.precision != "mxfp8":
        return all_gather_rows(local.astype(jnp.bfloat16), g.axes)
    return tuple(all_gather_rows(p, g.axes) for p in local)


def widened(g: UnitGeometry, fetched, *, columnwise: bool, ready=None) -> jax.Array:
    """``W [*batch, N, K]`` from what ``_gather`` gathered, once ``ready`` exists (as for
    ``gathered``)."""
    if g.precision != "mxfp8":
        return after(fetched, ready)[..., : g.out_features, :]
    return decode(after(Plane(*fetched), ready), g.out_features, columnwise=columnwise, tiled=g.tiled)


def _ready(own, token):
    """What an op's gathered weight waits for before it is widened: its own input ``own`` when
    the gather itself waited for something else (``token``), else nothing more."""
    return None if token is own else own


def after(tree, token):
    """``tree`` unchanged, but computed from ``token``: work on the result can neither start
    before ``token`` exists nor be merged with the same work on ``tree`` itself (the forward's
    gather of the same bytes, a recomputed forward under remat).

    ``lax.optimization_barrier`` means this, but XLA:CPU expands barriers before common-
    subexpression elimination; a select on ``token < -inf`` (never true, not even for NaN, yet
    not folded by XLA) is a real data dependency for the cost of one pass over a local shard.
    """
    if token is None or not hasattr(token, "dtype") or token.size == 0:
        return tree
    first = token.reshape(-1)[0]
    if not jnp.issubdtype(first.dtype, jnp.number):
        return tree
    never = first.astype(jnp.float32) < -jnp.inf
    return jax.tree.map(lambda x: jnp.where(never, jnp.zeros_like(x), x), tree)
