"""Flax NNX training with MXFP8 FSDP weights (SPEC §7).

One training step, with every mesh axis in the FSDP group and the batch split over it::

    master     fp32 DBuffer, BlockAtomic(32): each device holds whole 32-row blocks of each weight
      |  QuantizedDBuffer.quantize after every optimizer update: local, no communication
    quantized  four uint8 planes in the same layout
      |  forward:  all-gather rowwise data + scales (8-bit)     y  = x @ W.T   (W from rowwise)
      |  backward: all-gather columnwise data + scales (8-bit)  dx = dy @ W    (W from columnwise)
      |            wgrad dW = dy.T @ x accumulated in fp32, packed into the master layout and
      |            reduce-scattered with ONE psum_scatter of the flat buffer
    optax update on the shards (elementwise, no communication)

Eligible weights are the kernels of ``Linear`` whose two dimensions are multiples of 32. The
master holds them transposed, ``[out, in]`` (Transformer Engine's orientation), so rowwise blocks
run along ``in``, the forward GEMM's contraction axis, and columnwise blocks along ``out``, the
dgrad GEMM's. Every other parameter (biases, norms, odd-sized kernels) lives in a plain fp32
DBuffer (RowAtomic), all-gathered in fp32; autodiff turns that gather into a reduce-scatter.

Hopper and CPUs have no MXFP8 GEMM: the gathered planes are dequantized (exactly) and the GEMMs
run in the layer's compute dtype with fp32 accumulation. Quantization is the identity for the
gradient (straight-through).

How the backward gets the columnwise weights: each FSDP ``Linear`` call returns, besides its
output, a zero "tap" ``[out, in]``; the step differentiates with ``jax.vjp`` and feeds the
columnwise weights in as the taps' cotangents, which is where the dgrad reads them. The
columnwise gather therefore sits between the forward and the backward, and a data dependency on
the forward's loss keeps XLA from starting it earlier (``_after``): only the local columnwise
planes live through the forward (FSDP's reshard-after-forward). The cost of this mechanism:
a ``Linear`` must be called directly by ``loss_fn`` (not inside ``jax.lax.scan`` or a
``jax.checkpoint`` of the caller's own).

``precision="bf16"`` is the baseline with the same structure: the master shards are cast to bf16
locally and gathered as bf16, once for the forward and once for the backward.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mxfp8_jax._src import placement as pl
from mxfp8_jax._src.dbuffer import DBuffer
from mxfp8_jax._src.format import BLOCK, ScaleRule
from mxfp8_jax._src.layout import GlobalLayout
from mxfp8_jax._src.quantize import dequantize
from mxfp8_jax._src.quantized import QuantizedDBuffer, columnwise_scale_layout, rowwise_scale_layout

PRECISIONS = ("mxfp8", "bf16")


# ------------------------------------------------------------------------------------------------
# The layer


class Kernel(nnx.Param):
    """A ``Linear`` weight ``[in, out]``: the parameters ``FSDP`` may keep as MXFP8."""


@dataclasses.dataclass(frozen=True, eq=False)
class GatheredKernel:
    """What a ``Linear`` kernel holds inside an FSDP step (trace-time only, not a pytree).

    ``forward`` is ``W = kernel.T`` ``[out, in]`` in fp32 (exact dequantized values): the forward
    GEMM reads it and it receives the fp32 weight gradient. Each call appends ``(index, tap)`` to
    ``taps``; the step feeds the backward weights in as the taps' cotangents.
    """

    forward: jax.Array
    index: int
    taps: list


def _dot(a, b, dims, dtype):
    """``dot_general`` of operands rounded to ``dtype``, accumulated in fp32.

    XLA:CPU has no fast bf16 GEMM, so there the rounded operands are multiplied as fp32 (bf16
    products are exact in fp32: the same numbers up to summation order, several times faster).
    """
    a, b = a.astype(dtype), b.astype(dtype)
    if jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _matmul_t(x, w, dtype):
    """``x @ w.T`` for ``w [out, in]``: operands in ``dtype``, fp32 accumulation."""
    return _dot(x, w, (((x.ndim - 1,), (1,)), ((), ())), dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fsdp_linear(x, w_forward, dtype):
    """``(x @ w_forward.T, tap)``; the tap is zeros ``[out, in]`` whose cotangent is the dgrad weight."""
    return _matmul_t(x, w_forward, dtype).astype(dtype), jnp.zeros(w_forward.shape, jnp.bfloat16)


def _fsdp_linear_fwd(x, w_forward, dtype):
    return _fsdp_linear(x, w_forward, dtype), x


def _fsdp_linear_bwd(dtype, x, cotangents):
    dy, w_backward = cotangents
    # dx [..., in] = dy @ W contracts over out: the columnwise blocks of W
    dx = _dot(dy, w_backward, (((dy.ndim - 1,), (0,)), ((), ())), dtype)
    # dW [out, in] = dy.T @ x over every leading axis, in fp32
    dw = _dot(dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]), (((0,), (0,)), ((), ())), dtype)
    return dx.astype(x.dtype), dw


_fsdp_linear.defvjp(_fsdp_linear_fwd, _fsdp_linear_bwd)


class Linear(nnx.Module):
    """``y = x @ kernel + bias`` with a ``Kernel`` parameter ``[in, out]``, like ``nnx.Linear``.

    Outside an FSDP step it is an ordinary dense layer: operands in ``dtype``, fp32 accumulation,
    output in ``dtype``. Inside one, an eligible kernel holds a ``GatheredKernel``.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 dtype=jnp.bfloat16, param_dtype=jnp.float32,
                 kernel_init=nnx.initializers.lecun_normal(), rngs: nnx.Rngs):
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.kernel = Kernel(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else None

    def __call__(self, x):
        kernel = self.kernel.get_value()
        if isinstance(kernel, GatheredKernel):
            y, tap = _fsdp_linear(x, kernel.forward, self.dtype)
            kernel.taps.append((kernel.index, tap))
        else:
            y = _matmul_t(x, kernel.T, self.dtype).astype(self.dtype)
        if self.bias is not None:
            y = y + self.bias.get_value().astype(self.dtype)
        return y


# ------------------------------------------------------------------------------------------------
# Train state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a step updates. Invariant: ``quantized`` is the quantization of ``master``.

    ``master``: fp32 DBuffer of the eligible kernels, transposed ``[out, in]``, BlockAtomic(32).
    ``quantized``: its MXFP8 planes (QuantizedDBuffer), or None under ``precision="bf16"``.
    ``plain``: fp32 DBuffer of the other parameters (RowAtomic), or None when there are none.
    ``opt_state``: the optax state of ``(master.data, plain.data)``, sharded like them.
    """

    master: DBuffer
    quantized: QuantizedDBuffer | None
    plain: DBuffer | None
    opt_state: Any
    step: jax.Array


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One model parameter as the plan sees it; ``path`` as in ``nnx.to_flat_state``."""

    path: tuple[str | int, ...]
    shape: tuple[int, ...]
    dtype: Any
    eligible: bool

    @property
    def name(self) -> str:
        return "/".join(map(str, self.path))


# ------------------------------------------------------------------------------------------------
# The plan


class FSDP:
    """MXFP8 FSDP training of an NNX model over every axis of ``mesh``.

    ``FSDP(model, mesh)`` reads the model's structure (not its values): which parameters are
    eligible, the master and plain layouts. Then::

        state = fsdp.init(model, tx)           # shard, quantize, optimizer state
        step = fsdp.train_step(loss_fn, tx)    # jitted; donates the state
        state, loss = step(state, batch)
        model = fsdp.gather(state)             # an ordinary nnx module again

    ``loss_fn(model, batch) -> scalar`` is the mean loss over the batch it is given. Each device
    runs it on its slice of the batch (every leaf's leading axis is split over the mesh) and the
    step returns the mean over devices. The model may hold only ``nnx.Param`` state.
    """

    def __init__(self, model: nnx.Module, mesh: Mesh, *, precision: str = "mxfp8", scale_rule: str = "rceil"):
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}")
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")
        self.mesh = Mesh(mesh.devices, mesh.axis_names)  # Auto axes: shard_map does the placing
        self.precision = precision
        self.scale_rule = ScaleRule.parse(scale_rule).value
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError(
                "model holds state other than nnx.Param (e.g. batch statistics or RNG streams); "
                "FSDP trains Param-only models"
            )
        self._graphdef, self._rest = graphdef, rest
        self._treedef = jax.tree.structure(params)  # one leaf per Variable: its value
        with_paths = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]
        self.params = tuple(
            ParamInfo(_path_names(path), tuple(v.get_value().shape), v.get_value().dtype, _eligible(v))
            for path, v in with_paths
        )
        self.eligible = tuple(j for j, p in enumerate(self.params) if p.eligible)
        self.others = tuple(j for j, p in enumerate(self.params) if not p.eligible)
        if not self.eligible:
            raise ValueError(
                f"model has no eligible weight: FSDP keeps as MXFP8 the kernels of "
                f"mxfp8_jax.flax.Linear whose in and out features are both multiples of {BLOCK}; "
                f"2-D parameters found: {[p.shape for p in self.params if len(p.shape) == 2]}"
            )
        ndim = len(mesh.axis_names)
        self.master_placements = (pl.BlockAtomic(BLOCK),) * ndim
        self.plain_placements = (pl.RowAtomic(),) * ndim
        shapes = [self.params[j].shape[::-1] for j in self.eligible]  # [out, in]
        self._empty_quantized = QuantizedDBuffer.empty(self.mesh, self.master_placements, shapes)
        self.layout: GlobalLayout = self._empty_quantized.layout
        self.plain_layout: GlobalLayout | None = (
            GlobalLayout.build([self.params[j].shape for j in self.others], self.mesh.size)
            if self.others else None
        )
        self._axes = pl.partition_spec(self.mesh, self.master_placements)[0]  # collective axes
        self._gather = _Gather(self.mesh, self.layout, precision, self._axes)

    # -- state ---------------------------------------------------------------------------------

    def init(self, model: nnx.Module, tx) -> TrainState:
        """Shards ``model``'s parameters (one host-side pack per buffer), quantizes, inits ``tx``."""
        values = self._values_of(model)
        master = DBuffer.distribute_tensors(
            [np.asarray(values[j], np.float32).T for j in self.eligible], self.mesh,
            self.master_placements, dtype=jnp.float32, layout=self.layout,
        )
        plain = None
        if self.others:
            plain = DBuffer.distribute_tensors(
                [np.asarray(values[j], np.float32) for j in self.others], self.mesh,
                self.plain_placements, dtype=jnp.float32, layout=self.plain_layout,
            )
        quantized = self._quantize(self._empty_quantized, master)
        opt_state = jax.jit(tx.init)(_opt_params(master, plain))
        state = TrainState(master, quantized, plain, opt_state, jnp.zeros((), jnp.int32))
        return jax.device_put(state, self._shardings(state))

    def gather(self, state: TrainState) -> nnx.Module:
        """The model with the full fp32 master parameters (one all-gather per buffer)."""
        values = [None] * len(self.params)
        for j, w in zip(self.eligible, state.master.get_tensors()):
            values[j] = w.T.astype(self.params[j].dtype)
        if state.plain is not None:
            for j, p in zip(self.others, state.plain.get_tensors()):
                values[j] = p.astype(self.params[j].dtype)
        return self._merge(values)

    # -- steps ---------------------------------------------------------------------------------

    def place_batch(self, batch):
        """``batch`` with every leaf's leading axis split over the mesh (as a step takes it)."""
        for leaf in jax.tree.leaves(batch):
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] % self.mesh.size:
                raise ValueError(
                    f"batch leaf of shape {np.shape(leaf)}: its leading (batch) axis must be "
                    f"divisible by the mesh's {self.mesh.size} devices"
                )
        return jax.device_put(batch, NamedSharding(self.mesh, PartitionSpec(self._axes)))

    def loss_and_grads(self, loss_fn: Callable) -> Callable:
        """``fn(state, batch) -> (loss, master_grad, plain_grad)``, jitted: the step's gradients as
        DBuffers with the master / plain placements (``plain_grad`` None without plain params)."""
        jitted = jax.jit(self._grads_fn(loss_fn))
        return lambda state, batch: jitted(state, self.place_batch(batch))

    def train_step(self, loss_fn: Callable, tx) -> Callable:
        """``step(state, batch) -> (state, loss)``: gradients, the ``tx`` update on the shards,
        re-quantization. Jitted; the input state is donated."""
        jitted = jax.jit(self._step(loss_fn, tx), donate_argnums=0)
        return lambda state, batch: jitted(state, self.place_batch(batch))

    def lower_train_step(self, loss_fn: Callable, tx, state: TrainState, batch):
        """``train_step`` lowered for ``state`` and ``batch``. ``.compile()`` gives a step to call
        as ``compiled(state, fsdp.place_batch(batch))`` (donating ``state``) and its HLO text."""
        return jax.jit(self._step(loss_fn, tx), donate_argnums=0).lower(state, self.place_batch(batch))

    # -- internals -----------------------------------------------------------------------------

    def _step(self, loss_fn: Callable, tx) -> Callable:
        grads_fn = self._grads_fn(loss_fn)

        def step(state: TrainState, batch):
            loss, g_master, g_plain = grads_fn(state, batch)
            params = _opt_params(state.master, state.plain)
            grads = (g_master.data, None if g_plain is None else g_plain.data)
            updates, opt_state = tx.update(grads, state.opt_state, params)
            new = jax.tree.map(lambda p, u: p + u.astype(p.dtype), params, updates)
            master = dataclasses.replace(state.master, data=new[0])
            plain = None if state.plain is None else dataclasses.replace(state.plain, data=new[1])
            quantized = self._quantize(state.quantized, master)
            new_state = TrainState(master, quantized, plain, opt_state, state.step + 1)
            return lax.with_sharding_constraint(new_state, self._shardings(new_state)), loss

        return step

    def _grads_fn(self, loss_fn: Callable) -> Callable:
        """Loss and gradients of one step: a single shard_map over the mesh."""
        mesh, axes, n, gather = self.mesh, self._axes, self.mesh.size, self._gather
        spec = PartitionSpec(axes)
        rep = (pl.Replicate(),) * len(mesh.axis_names)
        plain_layout = self.plain_layout

        def local(master, planes_fwd, planes_bwd, plain, batch):
            taps = []  # (weight index, tap) of every FSDP Linear call, in call order

            def forward(master, plain):
                taps.clear()
                kernels = [GatheredKernel(w, i, taps) for i, w in enumerate(gathered_weights(gather, master, planes_fwd))]
                others = []
                if plain is not None:
                    full = lax.all_gather(plain, axes, tiled=True)
                    others = DBuffer(full, mesh, rep, plain_layout).get_tensors()
                loss = loss_fn(self._merge(self._interleave(kernels, others)), batch) / n
                return loss, tuple(t for _, t in taps)

            (loss, _), pullback = jax.vjp(forward, master, plain)
            w_backward = gather.backward(*_after((master, planes_bwd), loss))
            g_master, g_plain = pullback((jnp.ones_like(loss), tuple(w_backward[i] for i, _ in taps)))
            return lax.psum(loss, axes), g_master, g_plain

        def grads_fn(state: TrainState, batch):
            q = state.quantized
            if self.precision == "mxfp8":
                planes_fwd = (q.rowwise_data.data, q.rowwise_scale.data)
                planes_bwd = (q.columnwise_data.data, q.columnwise_scale.data)
            else:
                planes_fwd = planes_bwd = ()
            plain = None if state.plain is None else state.plain.data
            plain_spec = None if plain is None else spec
            fn = jax.shard_map(
                local, mesh=mesh,
                in_specs=(spec, (spec,) * len(planes_fwd), (spec,) * len(planes_bwd), plain_spec,
                          jax.tree.map(lambda _: spec, batch)),
                out_specs=(PartitionSpec(), spec, plain_spec),
                check_vma=False,
            )
            loss, g_master, g_plain = fn(state.master.data, planes_fwd, planes_bwd, plain, batch)
            g_master = DBuffer(g_master, mesh, self.master_placements, self.layout)
            if g_plain is not None:
                g_plain = DBuffer(g_plain, mesh, self.plain_placements, plain_layout)
            return loss, g_master, g_plain

        return grads_fn

    def _quantize(self, quantized: QuantizedDBuffer | None, master: DBuffer):
        if self.precision != "mxfp8":
            return None
        return quantized.quantize(master, scale_rule=self.scale_rule)

    def _shardings(self, state: TrainState):
        """Flat buffers (and optimizer moments of their size) sharded over the mesh; the rest
        (step counters, scalars) replicated. Init and step agree, so the step compiles once."""
        sharded = {self.layout.physical_size}
        if self.plain_layout is not None:
            sharded.add(self.plain_layout.physical_size)
        for plane in () if state.quantized is None else state.quantized.planes:
            if plane is not None:
                sharded.add(plane.layout.physical_size)
        flat, replicated = NamedSharding(self.mesh, PartitionSpec(self._axes)), NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(lambda a: flat if np.ndim(a) == 1 and np.shape(a)[0] in sharded else replicated, state)

    def _values_of(self, model: nnx.Module) -> list:
        _, params, _ = nnx.split(model, nnx.Param, ...)
        variables = jax.tree.leaves(params, is_leaf=_is_variable)
        shapes = tuple(tuple(v.get_value().shape) for v in variables)
        if shapes != tuple(p.shape for p in self.params):
            raise ValueError(
                f"model has parameter shapes {shapes}, but this FSDP plan was built for "
                f"{tuple(p.shape for p in self.params)}"
            )
        return [v.get_value() for v in variables]

    def _merge(self, values) -> nnx.Module:
        return nnx.merge(self._graphdef, jax.tree.unflatten(self._treedef, values), self._rest)

    def _interleave(self, kernels, others) -> list:
        values = [None] * len(self.params)
        for j, k in zip(self.eligible, kernels):
            values[j] = k
        for j, o in zip(self.others, others):
            values[j] = o.astype(self.params[j].dtype)
        return values


def _path_names(path) -> tuple[str | int, ...]:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _eligible(v: nnx.Variable) -> bool:
    shape = v.get_value().shape
    return isinstance(v, Kernel) and len(shape) == 2 and shape[0] % BLOCK == 0 and shape[1] % BLOCK == 0


def _after(tree, token):
    """``tree`` unchanged, but computed from ``token`` (a float scalar): work on the result can
    neither start before ``token`` exists nor be merged with the same work on ``tree`` itself.

    ``lax.optimization_barrier`` means this, but XLA:CPU expands barriers before common-
    subexpression elimination; a select on ``token < -inf`` (never true, not even for NaN, yet
    not folded by XLA) is a real data dependency for the cost of one pass over a local shard.
    """
    never = token < -jnp.inf
    return jax.tree.map(lambda x: jnp.where(never, jnp.zeros_like(x), x), tree)


def _opt_params(master: DBuffer, plain: DBuffer | None):
    return (master.data, None if plain is None else plain.data)


# ------------------------------------------------------------------------------------------------
# Gathering weights, per device (inside the step's shard_map)


@dataclasses.dataclass(frozen=True)
class _Gather:
    """How a device turns its master segment / quantized planes into full ``[out, in]`` weights."""

    mesh: Mesh
    layout: GlobalLayout
    precision: str
    axes: Any

    def _replicated(self, full, layout) -> DBuffer:
        return DBuffer(full, self.mesh, (pl.Replicate(),) * len(self.mesh.axis_names), layout)

    def _all_gather(self, x):
        return lax.all_gather(x, self.axes, tiled=True)

    def _mxfp8(self, planes, columnwise: bool, dtype):
        data, scale = (self._all_gather(p) for p in planes)
        lay, rep = self.layout, (pl.Replicate(),) * len(self.mesh.axis_names)
        if columnwise:
            q = QuantizedDBuffer(None, self._replicated(data, lay), None,
                                 self._replicated(scale, columnwise_scale_layout(lay)),
                                 self.mesh, lay, rep, rep)
        else:
            q = QuantizedDBuffer(self._replicated(data, lay), None,
                                 self._replicated(scale, rowwise_scale_layout(lay)), None,
                                 self.mesh, lay, rep, rep)
        return tuple(
            dequantize(q.get_tensor_view(i), columnwise=columnwise, dtype=dtype)
            for i in range(lay.num_tensors)
        )

    def _bf16(self, master):
        # Gathered as uint16 bit patterns: XLA may otherwise hoist the later convert to fp32
        # above the all-gather and move twice the bytes.
        bits = lax.bitcast_convert_type(master.astype(jnp.bfloat16), jnp.uint16)
        full = lax.bitcast_convert_type(self._all_gather(bits), jnp.bfloat16)
        return tuple(self._replicated(full, self.layout).get_tensors())

    def forward(self, master, planes):
        """fp32 weights for the forward GEMMs (exact dequantized values)."""
        if self.precision == "mxfp8":
            return self._mxfp8(planes, False, jnp.float32)
        return tuple(w.astype(jnp.float32) for w in self._bf16(master))

    def backward(self, master, planes):
        """bf16 weights for the dgrad GEMMs (exact for MXFP8 values)."""
        if self.precision == "mxfp8":
            return self._mxfp8(planes, True, jnp.bfloat16)
        return self._bf16(master)

    def reduce_scatter(self, dws):
        """fp32 weight gradients ``[out, in]`` -> this device's segment of their sum over devices:
        packed into the layout, then one psum_scatter of the flat buffer."""
        flat = _pack(self.layout, [d.astype(jnp.float32) for d in dws])
        return lax.psum_scatter(flat, self.axes, scatter_dimension=0, tiled=True)


def _pack(layout: GlobalLayout, tensors) -> jax.Array:
    """The physical flat buffer of ``tensors``: each segment's pieces in place, zeros elsewhere."""
    flats = [t.reshape(-1) for t in tensors]
    parts = []
    for k in range(layout.dp_size):
        at = 0
        for i, row, rows, offset in layout.pieces(k):
            if offset > at:
                parts.append(jnp.zeros((offset - at,), jnp.float32))
            n = layout.row_size(i)
            parts.append(flats[i][row * n : (row + rows) * n])
            at = offset + rows * n
        if layout.segment_capacity > at:
            parts.append(jnp.zeros((layout.segment_capacity - at,), jnp.float32))
    return jnp.concatenate(parts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gathered_weights(gather: _Gather, master, planes):
    """Forward weights from this device's shards; their gradient returns as one reduce-scatter
    into ``master``'s segment (quantization is the identity for the gradient)."""
    return gather.forward(master, planes)


def _gathered_weights_fwd(gather, master, planes):
    return gather.forward(master, planes), None


def _gathered_weights_bwd(gather, _, dws):
    return gather.reduce_scatter(dws), None


gathered_weights.defvjp(_gathered_weights_fwd, _gathered_weights_bwd)
