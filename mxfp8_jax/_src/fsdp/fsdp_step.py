"""One FSDP step: the loss on the whole batch, its gradients, the optimizer update.

``Steps`` builds, for a plan's ``StateLayout``, the functions a step is made of: the loss as a
function of arrays (``traceable``), traced on the batch it gets and evaluated by ``fsdp_eval``
(each weight read in an island), the gradients and the model's new other state
(``grads_fn``), and the whole step with the ``tx`` update and the re-quantization of the
masters (``step``). Under tensor parallelism all of it runs inside a ``shard_map`` manual over
the tp axis only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mxfp8_jax._src.core import platforms
from mxfp8_jax._src.fsdp import fsdp_specs
from mxfp8_jax._src.fsdp.fsdp_eval import Islands, PlainValue, UnitValue, evaluate
from mxfp8_jax._src.fsdp.fsdp_plan import check_uses
from mxfp8_jax._src.fsdp.fsdp_state import StateLayout, TrainState, UnitPlanes
from mxfp8_jax._src.fsdp.fsdp_topology import Topology
from mxfp8_jax._src.fsdp.fsdp_trace import View, analyse, trace
from mxfp8_jax._src.fsdp.fsdp_unit import Gemms


class Partition:
    """A model's variables split into the plan's parameters (those at ``paths``, nnx paths) and
    the rest of its state: the structures to split a model of that graph and merge it back.

    Args:
      model: the ``nnx.Module`` (concrete or abstract); only its structure is kept.
      paths: the nnx paths (tuples of names and indices) of the variables that are parameters.
    """

    def __init__(self, model: nnx.Module, paths) -> None:
        self.paths = frozenset(tuple(p) for p in paths)
        self.graphdef, params, rest = self.split(model)
        self.treedef = jax.tree.structure(params)  # one leaf per Variable: its value
        self.rest_treedef = jax.tree.structure(rest)

    def holds(self, path, _variable=None) -> bool:
        """Whether the variable at ``path`` is a parameter (an nnx filter)."""
        return tuple(path) in self.paths

    def split(self, model: nnx.Module):
        """``(graphdef, parameters State, rest State)`` of ``model``."""
        return nnx.split(model, self.holds, ...)

    def merge(self, values, rest) -> nnx.Module:
        """The model from the parameters' and the rest's leaves (as ``split`` orders them)."""
        return nnx.merge(
            self.graphdef, jax.tree.unflatten(self.treedef, values), jax.tree.unflatten(self.rest_treedef, rest)
        )


class Steps:
    """The step functions of one plan over ``mesh`` (``axes``: every mesh axis, innermost first;
    ``fsdp_axes``: those the batch is split over, all but ``tp_axis``). ``partition``,
    ``rest_avals``: the model's structure (the variables the plan holds as parameters and its
    other state); ``gemms``: how the units' GEMMs multiply (``fsdp_unit.Gemms``, its ``mxfp8``
    the mode of MXFP8 GEMMs or None), for the platform of ``mesh``.
    ``traced`` (the plan traced the loss) and ``layout`` (the plan's ``StateLayout``), and
    ``example_tree`` (the structure of the example batch traced), are set once the plan exists."""

    def __init__(
        self,
        mesh: Mesh,
        *,
        axes,
        fsdp_axes,
        tp_axis: str | None,
        tp_size: int,
        partition: Partition,
        rest_avals: tuple,
        gemms: Gemms,
    ) -> None:
        self.mesh, self.axes, self.fsdp_axes = mesh, axes, fsdp_axes
        self.tp_axis, self.tp_size = tp_axis, tp_size
        self.partition = partition
        self.rest_avals, self.gemms = rest_avals, gemms
        self.platform = platforms.of_mesh(mesh)
        self.layout: StateLayout | None = None
        self.prefetch = 0  # how many layers ahead the forward gathers start (FSDP's prefetch=)
        self.traced = False
        self.example_tree = None

    def place_batch(self, batch: Any) -> Any:
        """``FSDP.place_batch`` (documented there)."""
        self.check_batch(batch)
        sharding = NamedSharding(self.mesh, self.batch_spec)
        if all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(batch)):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), batch)
        return jax.device_put(batch, sharding)

    def check_batch(self, batch, argname: str = "batch") -> None:
        if self.example_tree is not None and jax.tree.structure(batch) != self.example_tree:
            raise ValueError(
                f"{argname} has the structure {jax.tree.structure(batch)}, but FSDP traced the loss on an "
                f"example_batch with the structure {self.example_tree}; a step takes batches shaped like the "
                "example (build FSDP with an example of the batches the steps get)"
            )
        n_batch = self.mesh.size // self.tp_size
        for leaf in jax.tree.leaves(batch):
            shape = np.shape(leaf)
            if len(shape) == 0 or shape[0] % n_batch:
                raise ValueError(
                    f"{argname} leaf of shape {shape}: its leading (batch) axis must be divisible by the "
                    f"{n_batch} devices it is split over"
                )
            if self.tp_axis is not None and (len(shape) < 2 or shape[1] % self.tp_size):
                raise ValueError(
                    f"{argname} leaf of shape {shape}: under tp_axis={self.tp_axis!r} its second (sequence) "
                    f"axis is split over {self.tp_size} devices and must be divisible by them"
                )

    @functools.cached_property
    def batch_spec(self) -> PartitionSpec:
        if self.tp_axis is None:
            return PartitionSpec(self.axes)
        return PartitionSpec(self.fsdp_axes, self.tp_axis)

    def train_jit(self, loss_fn: Callable, tx, has_aux: bool):
        return jax.jit(self.step(loss_fn, tx, has_aux), donate_argnums=0, compiler_options=self.compiler_options)

    @functools.cached_property
    def compiler_options(self) -> dict | None:
        """Under tensor parallelism the step is manual over tp only, and XLA:CPU's all-reduce
        promotion pass aborts the compilation on the bf16 all-reduces its partitioner makes there
        (a bf16 psum or reduce-scatter over tp, or the transpose of a bf16 all-gather): skip it."""
        if self.tp_axis is None or self.platform != "cpu":
            return None
        return {"xla_disable_hlo_passes": "all-reduce-promotion"}

    def step(self, loss_fn: Callable, tx, has_aux: bool) -> Callable:
        grads_fn = self.grads_fn(loss_fn, has_aux)
        quantize_local = self.layout.quantize_local()
        frozen_planes = [p.name for p in self.layout.mxfp8_units if not p.trained]

        def step(state: TrainState, batch):
            self.layout.check_state(state, "state")
            loss, aux, grads, rest = grads_fn(state, batch)
            params = self.layout.param_tree(state.master)
            self.layout.check_opt_state(tx, params, state.opt_state)
            updates, opt_state = tx.update(self.layout.param_tree(grads), state.opt_state, params)
            master = self.layout.from_param_tree(optax.apply_updates(params, updates))
            master = {k: v.astype(jnp.float32) for k, v in master.items()}
            planes = {**quantize_local(master), **{k: state.quantized[k] for k in frozen_planes}}  # frozen: as they are
            new_state = TrainState(master, planes, state.frozen, tuple(rest), opt_state, state.step + 1)
            new_state = lax.with_sharding_constraint(new_state, self.layout.shardings(new_state))
            return (new_state, loss, aux) if has_aux else (new_state, loss)

        return step

    def traceable(
        self, loss_fn: Callable, partition: Partition | None = None, assigned: list | None = None
    ) -> Callable:
        """``(parameter values, rest values, batch) -> (loss_fn's output, rest values after)``:
        the loss as a function of arrays, for tracing.

        Args:
          loss_fn: ``loss_fn(model, batch)``.
          partition: the split of the model's variables into parameters and rest (default: the
            plan's).
          assigned: a list that a trace fills with one bool per parameter: whether the loss
            assigned the variable another value (BatchNorm's statistics, a counter).

        Returns:
          The function, to trace.
        """
        partition = self.partition if partition is None else partition

        def fn(values, rest, batch):
            model = partition.merge(values, rest)
            out = loss_fn(model, batch)
            _, params_after, after = partition.split(model)
            if assigned is not None:
                assigned[:] = [a is not b for a, b in zip(jax.tree.leaves(params_after), values)]
            return out, jax.tree.leaves(after)

        return fn

    def grads_fn(self, loss_fn: Callable, has_aux: bool, *, differentiate: bool = True) -> Callable:
        """Loss, aux, gradients and the model's new other state of one step, on the whole batch
        (``differentiate=False``: no gradients, an empty dict; the loss may then read parameters
        inside a ``while`` loop, which jax cannot differentiate in reverse mode).

        The loss is evaluated under ``jit`` on global arrays (``fsdp_eval``), each unit read in an
        island over the FSDP axes. Under tensor parallelism the whole of it runs inside a
        ``shard_map`` manual over the tp axis only (the model's own collectives name it): each tp
        rank evaluates its part, global over the FSDP axes, and the loss, aux and floating state
        are averaged over tp."""
        traceable = self.traceable(loss_fn)
        islands = Islands(Topology.of(self.mesh, self.tp_axis), self.prefetch)
        tp = self.tp_axis

        def loss_and_grads(master, planes, frozen, rest, batch):
            avals = [jax.ShapeDtypeStruct(p.step_shape, p.dtype) for p in self.layout.params]
            closed, shapes = trace(traceable, avals, list(self.rest_avals), batch, forbidden=self.fsdp_axis_sizes)
            uses = analyse(closed, len(self.layout.params))
            check_uses(self.layout.params, uses, traced=self.traced)
            if differentiate:
                refuse_while(self.layout.params, uses)
            out_tree = jax.tree.structure(shapes)
            keys = self.step_keys(rest)
            batch_leaves = jax.tree.leaves(batch)
            specs = [None] * (len(self.layout.params) + len(keys))
            specs += [fsdp_specs.batch_leaf_spec(np.ndim(x), (self.fsdp_axes,)) for x in batch_leaves]

            def loss_of(master):
                args = [*self.step_values(master, planes, frozen), *keys, *batch_leaves]
                out, after = jax.tree.unflatten(out_tree, evaluate(closed, args, specs, islands))
                loss, aux = split_loss(out, has_aux, averaged=tp is not None)
                return loss.astype(jnp.float32) / self.tp_size, (aux, after)  # under tp: a share of the mean

            if differentiate:
                (loss, (aux, after)), grads = jax.value_and_grad(loss_of, has_aux=True)(master)
            else:
                (loss, (aux, after)), grads = loss_of(master), {}
            after = self.next_rest(rest, after)
            if tp is None:
                return loss, aux, grads, after
            for p in self.layout.trained:  # whole on every tp rank, each rank's share of the tokens: summed
                if p.tp is None and p.name in grads:
                    grads[p.name] = lax.psum(grads[p.name], tp)
            return lax.psum(loss, tp), jax.tree.map(lambda a: lax.pmean(a, tp), aux), grads, after

        if tp is None:

            def grads_fn(state: TrainState, batch):
                return loss_and_grads(state.master, state.quantized, state.frozen, tuple(state.rest), batch)

            return grads_fn
        master_specs = {p.name: self.layout.tp_spec(p) for p in self.layout.trained}
        planes_specs = {p.name: UnitPlanes(*(self.layout.tp_spec(p),) * 4) for p in self.layout.mxfp8_units}
        frozen_specs = {p.name: self.layout.tp_spec(p) for p in self.layout.frozen}
        rest_specs = tuple(PartitionSpec() for _ in self.rest_avals)

        def grads_fn(state: TrainState, batch):
            batch_specs = jax.tree.map(lambda _: PartitionSpec(None, tp), batch)
            fn = jax.shard_map(
                loss_and_grads,
                mesh=self.mesh,
                in_specs=(master_specs, planes_specs, frozen_specs, rest_specs, batch_specs),
                out_specs=(PartitionSpec(), PartitionSpec(), master_specs if differentiate else {}, rest_specs),
                axis_names={tp},
                check_vma=False,
            )
            return fn(state.master, state.quantized, state.frozen, tuple(state.rest), batch)

        return grads_fn

    @functools.cached_property
    def fsdp_axis_sizes(self) -> tuple[tuple[str, int], ...]:
        """``(name, size)`` of each mesh axis the batch is split over (all but tp)."""
        return tuple((a, int(self.mesh.shape[a])) for a in self.mesh.axis_names if a != self.tp_axis)

    def step_values(self, master, planes, frozen) -> list:
        """Each parameter as the evaluated loss holds it (``fsdp_eval``). A frozen unit's leaves
        are its rows in ``frozen`` and its planes: not among the arrays differentiated (``master``),
        so the step computes no gradient for it and moves none."""
        values = []
        for j, p in enumerate(self.layout.params):
            if p.kind == "frozen":
                values.append(frozen[p.name])
            elif p.unit is not None:
                leaves = (master[p.name] if p.trained else frozen[p.name],)
                if p.kind == "mxfp8":
                    q = planes[p.name]
                    leaves += (q.rowwise_data, q.rowwise_scale, q.columnwise_data, q.columnwise_scale)
                view = View(j, tuple((a,) for a in range(len(p.step_shape))))
                gemm = self.gemms if p.kind == "mxfp8" else dataclasses.replace(self.gemms, mxfp8=None)
                values.append(UnitValue(p.name, p.unit, p.dtype, leaves, view, gemm=gemm))
            else:
                values.append(PlainValue(p.name, master[p.name], p.shard_axis, p.dtype))
        return values

    def step_keys(self, rest) -> list:
        """The model's other state as the loss sees it: RNG keys as they are (draws on the whole
        batch's shapes, the same bits however the mesh splits them where jax's threefry is
        partitionable), folded with the tp index under tensor parallelism (each tp rank holds
        other tokens)."""
        if self.tp_axis is None or not any(is_key(r) for r in rest):
            return list(rest)
        index = lax.axis_index(self.tp_axis)
        return [jax.random.fold_in(r, index) if is_key(r) else r for r in rest]

    def next_rest(self, before, after) -> tuple:
        """The model's other state after the step: keys as they were (each step draws by the
        advanced counts), the rest as the loss left it (batch statistics of the whole batch);
        under tensor parallelism floating values averaged over the tp ranks."""
        out = []
        for b, a in zip(before, after):
            if is_key(b):
                out.append(b)
            elif self.tp_axis is not None and jnp.issubdtype(a.dtype, jnp.floating):
                out.append(lax.pmean(a, self.tp_axis))
            else:
                out.append(a)
        return tuple(out)

    def merge(self, values, rest) -> nnx.Module:
        return self.partition.merge(values, rest)


def refuse_while(params, uses) -> None:
    """A ``ValueError`` when the loss reads a trained parameter inside a ``while`` loop (a
    ``lax.while_loop``, a ``fori_loop`` whose bounds are traced values): jax has no reverse-mode
    derivative of one, and the step needs the gradient."""
    for j, p in enumerate(params):
        if p.trained and p.kind != "frozen" and any(u.trips is None for u in uses.by_param[j]):
            raise ValueError(
                f"loss_fn reads {p.name} inside a lax.while_loop (or a lax.fori_loop whose bounds are traced "
                "values): jax cannot differentiate a while loop in reverse mode, so a training step cannot run "
                "it. Give fori_loop Python int bounds (it is then a scan) or use lax.scan; FSDP.eval_step runs "
                "the loop as it is"
            )


def split_loss(out, has_aux: bool, *, averaged: bool = False):
    """``loss_fn``'s output as ``(loss, aux)``, checked. ``averaged``: aux is averaged over the
    tensor-parallel ranks, so its leaves must be floating."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"loss_fn must return (loss, aux) with has_aux=True, got {type(out).__name__}")
        loss, aux = out
        for leaf in jax.tree.leaves(aux) if averaged else ():
            if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
                raise ValueError(
                    "under tp_axis, loss_fn's aux leaves must be floating (they are averaged over the tp ranks), "
                    f"got {jnp.result_type(leaf)}"
                )
    else:
        if isinstance(out, tuple):
            raise ValueError(
                "loss_fn returned a tuple; for (loss, aux) pass has_aux=True to train_step / loss_and_grads"
            )
        loss, aux = out, None
    check_loss_shape(loss)
    return loss, aux


def check_loss_shape(loss) -> None:
    """The loss (or the first of ``(loss, aux)``) is a floating scalar."""
    if isinstance(loss, tuple) and len(loss) == 2:
        loss = loss[0]
    shape = getattr(loss, "shape", np.shape(loss))
    if len(shape) != 0:
        raise ValueError(f"loss_fn must return a scalar (the loss of its batch), got shape {tuple(shape)}")
    if not jnp.issubdtype(getattr(loss, "dtype", jnp.result_type(loss)), jnp.floating):
        raise ValueError(f"loss_fn must return a floating scalar, got {getattr(loss, 'dtype', type(loss))}")


def dtype_of(leaf):
    return leaf.dtype if hasattr(leaf, "dtype") else jnp.asarray(leaf).dtype


def is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)
