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
import importlib.metadata
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from mxfp8_jax._src.compiled import xla_costs
from mxfp8_jax._src.core import jaxprs, platforms
from mxfp8_jax._src.fsdp import fsdp_specs
from mxfp8_jax._src.fsdp.fsdp_discover import check_loss_shape, traceable
from mxfp8_jax._src.fsdp.fsdp_eval import Islands, PlainValue, UnitValue, evaluate
from mxfp8_jax._src.fsdp.fsdp_plan import Plan, check_uses
from mxfp8_jax._src.fsdp.fsdp_planes import UnitPlanes, UnitShards
from mxfp8_jax._src.fsdp.fsdp_state import StateLayout, TrainState
from mxfp8_jax._src.fsdp.fsdp_trace import View, analyse, trace


class Steps:
    """The step functions of one plan: the loss evaluated on the whole batch, its gradients, and
    the training step with the optimizer update and the re-quantization of the masters.

    Args:
      plan: the ``Plan``; its topology, the model's structure (``partition``, ``rest_avals``),
        how the units' GEMMs multiply and the prefetch depth are read from it.
      layout: the plan's ``StateLayout``.
    """

    def __init__(self, plan: Plan, layout: StateLayout) -> None:
        self.plan, self.layout = plan, layout
        self.topology = plan.topology

    def place_batch(self, batch: Any) -> Any:
        """``batch`` with every leaf's leading axis split over the mesh (as a step takes it);
        under tensor parallelism the leading axis over the FSDP axes and the second (sequence)
        over the tp axis.

        ``jax.ShapeDtypeStruct`` leaves get the sharding attached (for lowering only).

        Args:
          batch: a pytree of arrays, or of ``jax.ShapeDtypeStruct``s only; every leaf's leading
            axis divisible by the devices it is split over (``mesh.size / tp_size``) and, under
            tensor parallelism, its second axis by ``tp_size`` (``ValueError`` otherwise).

        Returns:
          The same tree: ``jax.ShapeDtypeStruct``s with the ``NamedSharding`` attached, or the
          arrays placed with it (``jax.device_put``).
        """
        self.topology.check_batch(batch, "batch", self.plan.example_tree)
        sharding = NamedSharding(self.topology.mesh, self.topology.batch_spec)
        if all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(batch)):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), batch)
        return jax.device_put(batch, sharding)

    def train_jit(self, loss_fn: Callable, tx, has_aux: bool):
        return self.jit(self.step(loss_fn, tx, has_aux), donate_argnums=0)

    def jit(self, fn: Callable, **kwargs) -> Callable:
        """``fn`` jitted with the step's compiler options (``compiler_options``); for a GPU mesh
        under ``xla_costs="corrected"``, each of its programs compiled by
        ``xla_costs.compile`` (``xla_costs.CorrectedJit``), the scheduler's prices put right."""
        jitted = jax.jit(fn, compiler_options=self.compiler_options, **kwargs)
        return xla_costs.CorrectedJit(jitted) if self.corrected else jitted

    @property
    def corrected(self) -> bool:
        """Whether the steps compile with the scheduler's prices put right: a GPU mesh, under
        ``xla_costs="corrected"``."""
        return self.plan.xla_costs == "corrected" and platforms.is_gpu(self.topology.platform)

    def compile(self, lowered, options: dict | None = None):
        """A lowered step compiled as ``jit`` compiles it (``options``: more XLA options)."""
        return xla_costs.compile(lowered, options)[0] if self.corrected else xla_costs.compile_lowered(lowered, options)

    @functools.cached_property
    def compiler_options(self) -> dict | None:
        """XLA options of the step's compilation, by the mesh's platform.

        GPUs: XLA:GPU's collective pipeliner (``gpu_pipelining_options``) off, under either
        prices (``xla_costs``): a scan over remat layers gathers its next layer's first weights
        itself (``fsdp_fetch``) and hides the rest inside their own iteration, and the
        pipeliner, which takes every gather of the loop, then holds more memory for more exposed
        time (at hidden 2048 on 8 H100s, under XLA's own prices: 4.99 ms exposed against 1.43).
        An option the user sets in ``XLA_FLAGS`` is left to them.

        CPUs under tensor parallelism: the step is manual over tp only, and XLA:CPU's all-reduce
        promotion pass aborts the compilation on the bf16 all-reduces its partitioner makes there
        (a bf16 psum or reduce-scatter over tp, or the transpose of a bf16 all-gather): skip it."""
        if platforms.is_gpu(self.topology.platform):
            jaxlib = jaxprs.version_tuple(importlib.metadata.version("jaxlib"))
            return gpu_pipelining_options(jaxlib, os.environ.get("XLA_FLAGS", ""), pipelined=False) or None
        if self.topology.tp_axis is None or self.topology.platform != "cpu":
            return None
        return {"xla_disable_hlo_passes": "all-reduce-promotion"}

    def step(self, loss_fn: Callable, tx, has_aux: bool) -> Callable:
        grads_fn = self.grads_fn(loss_fn, has_aux)
        quantize_local = self.layout.quantize_local()
        frozen_planes = [p.name for p in self.plan.mxfp8_units if not p.trained]

        def step(state: TrainState, batch):
            loss, aux, grads, rest = grads_fn(state, batch)  # which checks the state
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

    def grads_fn(self, loss_fn: Callable, has_aux: bool, *, differentiate: bool = True) -> Callable:
        """Loss, aux, gradients and the model's new other state of one step, on the whole batch
        (``differentiate=False``: no gradients, an empty dict; the loss may then read parameters
        inside a ``while`` loop, which jax cannot differentiate in reverse mode).

        The loss is evaluated under ``jit`` on global arrays (``fsdp_eval``), each unit read in an
        island over the FSDP axes. Under tensor parallelism the whole of it runs inside a
        ``shard_map`` manual over the tp axis only (the model's own collectives name it): each tp
        rank evaluates its part, global over the FSDP axes, and the loss, aux and floating state
        are averaged over tp."""
        plan, layout, topology = self.plan, self.layout, self.topology
        fn = traceable(loss_fn, plan.partition)
        islands = Islands(topology, plan.prefetch, plan.keep_layers)
        tp = topology.tp_axis

        def loss_and_grads(master, planes, frozen, rest, batch):
            avals = [jax.ShapeDtypeStruct(p.step_shape, p.dtype) for p in plan.params]
            closed, shapes = trace(fn, avals, list(plan.rest_avals), batch, forbidden=topology.fsdp_axis_sizes)
            uses = analyse(closed, len(plan.params))
            check_uses(plan.params, uses, traced=plan.traced)
            if differentiate:
                refuse_while(plan.params, uses)
            out_tree = jax.tree.structure(shapes)
            keys = self.step_keys(rest)
            batch_leaves = jax.tree.leaves(batch)
            specs = [None] * (len(plan.params) + len(keys))
            specs += [fsdp_specs.batch_leaf_spec(np.ndim(x), (topology.fsdp_axes,)) for x in batch_leaves]

            def loss_of(master):
                args = [*self.step_values(master, planes, frozen), *keys, *batch_leaves]
                outs = evaluate(closed, args, specs, islands, drop_constraints=plan.model_constraints == "drop")
                out, after = jax.tree.unflatten(out_tree, outs)
                loss, aux = split_loss(out, has_aux, averaged=tp is not None)
                return loss.astype(jnp.float32) / topology.tp_size, (aux, after)  # under tp: a share of the mean

            if differentiate:
                (loss, (aux, after)), grads = jax.value_and_grad(loss_of, has_aux=True)(master)
            else:
                (loss, (aux, after)), grads = loss_of(master), {}
            after = self.next_rest(rest, after)
            if tp is None:
                return loss, aux, grads, after
            for p in plan.trained:  # whole on every tp rank, each rank's share of the tokens: summed
                if p.tp is None and p.name in grads:
                    grads[p.name] = lax.psum(grads[p.name], tp)
            return lax.psum(loss, tp), jax.tree.map(lambda a: lax.pmean(a, tp), aux), grads, after

        if tp is None:

            def grads_fn(state: TrainState, batch):
                layout.check_state(state, "state")  # when traced: once per structure of state
                return loss_and_grads(state.master, state.quantized, state.frozen, tuple(state.rest), batch)

            return grads_fn
        master_specs = {p.name: layout.tp_spec(p) for p in plan.trained}
        planes_specs = {p.name: UnitPlanes.like(layout.tp_spec(p), p.unit.blocks) for p in plan.mxfp8_units}
        frozen_specs = {p.name: layout.tp_spec(p) for p in plan.frozen}
        rest_specs = tuple(PartitionSpec() for _ in plan.rest_avals)

        def grads_fn(state: TrainState, batch):
            layout.check_state(state, "state")
            batch_specs = jax.tree.map(lambda _: PartitionSpec(None, tp), batch)
            fn = jax.shard_map(
                loss_and_grads,
                mesh=topology.mesh,
                in_specs=(master_specs, planes_specs, frozen_specs, rest_specs, batch_specs),
                out_specs=(PartitionSpec(), PartitionSpec(), master_specs if differentiate else {}, rest_specs),
                axis_names={tp},
                check_vma=False,
            )
            return fn(state.master, state.quantized, state.frozen, tuple(state.rest), batch)

        return grads_fn

    def step_values(self, master, planes, frozen) -> list:
        """Each parameter as the evaluated loss holds it (``fsdp_eval``). A frozen unit's leaves
        are its rows in ``frozen`` and its planes: not among the arrays differentiated (``master``),
        so the step computes no gradient for it and moves none."""
        values = []
        for j, p in enumerate(self.plan.params):
            if p.kind == "frozen":
                values.append(frozen[p.name])
            elif p.unit is not None:
                shards = UnitShards(master[p.name] if p.trained else frozen[p.name], planes.get(p.name))
                view = View(j, tuple((a,) for a in range(len(p.step_shape))))
                gemm = self.plan.gemms if p.kind == "mxfp8" else dataclasses.replace(self.plan.gemms, mxfp8=None)
                values.append(UnitValue(p.name, p.unit, p.dtype, shards, view, gemm=gemm, path=p.path))
            else:
                values.append(PlainValue(p.name, master[p.name], p.shard_axis, p.dtype, path=p.path))
        return values

    def step_keys(self, rest) -> list:
        """The model's other state as the loss sees it: RNG keys as they are (draws on the whole
        batch's shapes, the same bits however the mesh splits them where jax's threefry is
        partitionable), folded with the tp index under tensor parallelism (each tp rank holds
        other tokens)."""
        if self.topology.tp_axis is None or not any(is_key(r) for r in rest):
            return list(rest)
        index = lax.axis_index(self.topology.tp_axis)
        return [jax.random.fold_in(r, index) if is_key(r) else r for r in rest]

    def next_rest(self, before, after) -> tuple:
        """The model's other state after the step: keys as they were (each step draws by the
        advanced counts), the rest as the loss left it (batch statistics of the whole batch);
        under tensor parallelism floating values averaged over the tp ranks."""
        out = []
        for b, a in zip(before, after):
            if is_key(b):
                out.append(b)
            elif self.topology.tp_axis is not None and jnp.issubdtype(a.dtype, jnp.floating):
                out.append(lax.pmean(a, self.topology.tp_axis))
            else:
                out.append(a)
        return tuple(out)


# XLA:GPU's collective pipeliner: from jaxlib 0.11 an enum option per collective, before a bool
# one (the bool's name is still read from XLA_FLAGS, as an alias of the enum's); whether each is
# on where asked for (``pipelined``: the steps no longer ask, see ``compiler_options``). The
# reduce-scatters are not even then, whose default follows the all-gathers': pipelined too, they
# shorten XLA's estimate further, but the compiled step's temp memory then grows per layer by
# more than the remat scan's carry.
PIPELINING = (
    ("xla_gpu_pipeline_all_gather", "xla_gpu_enable_pipelined_all_gather", True),
    ("xla_gpu_pipeline_reduce_scatter", "xla_gpu_enable_pipelined_reduce_scatter", False),
)


def gpu_pipelining_options(jaxlib: tuple[int, ...], xla_flags: str, pipelined: bool = True) -> dict:
    """The compiler options for XLA:GPU's collective pipeliner, spelled as ``jaxlib`` (a version
    tuple) spells them: with ``pipelined`` (XLA's own prices) as ``PIPELINING`` says (all-gathers
    on, reduce-scatters off), else both off. A collective whose option ``xla_flags`` (the
    ``XLA_FLAGS`` value) sets, in either spelling, is left out, so that the user's setting
    stands (a per-compilation option would override it)."""
    given = set(re.findall(r"--?(xla_[A-Za-z0-9_]+)", xla_flags))
    out: dict = {}
    for name, old, on in PIPELINING:
        on = on and pipelined
        if given & {name, old}:
            continue
        if jaxlib >= (0, 11):
            out[name] = "COLLECTIVE_PIPELINING_MODE_ON" if on else "COLLECTIVE_PIPELINING_MODE_OFF"
        elif on:
            out[old] = True
    return out


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


def is_key(x) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)
