"""A plan from an NNX model: which variables are parameters, how the loss reads them, and what
each becomes (``make_plan``).

The discovery, in order:

1. the arguments are checked, and the mesh becomes a ``Topology``;
2. ``trainable`` names the trained variables. Every ``nnx.Param`` is a parameter too, and with a
   loss to trace, so is every other floating variable (a candidate frozen weight);
3. the model splits into those parameters and its other state (``Partition``);
4. the loss is traced on the example batch (``fsdp_trace``). Every parameter a GEMM contracts or
   a lookup reads is a unit. A candidate that no GEMM or lookup reads, or that the loss assigns
   (BatchNorm's statistics), goes back to the model's other state, and the loss is traced
   again without it. Without a loss, units are the kernels of ``nnx.Linear`` and
   ``mxfp8_jax.flax.Linear`` by class;
5. ``fsdp_plan.plan_from_uses`` classifies every parameter on the topology, and the result is
   one immutable ``Plan``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import filterlib

from mxfp8_jax._src.core import jaxprs
from mxfp8_jax._src.fsdp import fsdp_specs
from mxfp8_jax._src.fsdp.flax_layers import unit_kernel_shape
from mxfp8_jax._src.fsdp.fsdp_geometry import PRECISIONS, Gemms
from mxfp8_jax._src.fsdp.fsdp_plan import (
    XLA_COSTS,
    Plan,
    check_blocks,
    check_rule,
    check_rule_matches,
    plan_from_uses,
    uses_from_layers,
    with_blocks,
)
from mxfp8_jax._src.fsdp.fsdp_specs import MODEL_CONSTRAINTS, ModelConstraintWarning
from mxfp8_jax._src.fsdp.fsdp_table import constraints_line
from mxfp8_jax._src.fsdp.fsdp_topology import Topology
from mxfp8_jax._src.fsdp.fsdp_trace import analyse, trace
from mxfp8_jax._src.numerics.format import BLOCK, ScaleRule
from mxfp8_jax._src.ops import mxfp8_gemm


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

    def values(self, model: nnx.Module) -> tuple[list, list]:
        """The parameters' values and the rest's, in the order ``split`` gives them."""
        _, params, rest = self.split(model)
        flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_variable)[0]
        return [v.get_value() for _, v in flat], jax.tree.leaves(rest)

    def found(self, model: nnx.Module) -> tuple[list, tuple, tuple[str, ...]]:
        """``(path, shape, dtype)`` of each parameter of ``model``, the avals of its other state and
        that state's paths (names joined by ``/``)."""
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model must be a flax.nnx.Module (the plan was built for one), got {type(model).__name__}")
        _, params, rest = self.split(model)
        flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_variable)[0]
        found = [(path_names(k), tuple(np.shape(v.get_value())), jnp.dtype(v.get_value().dtype)) for k, v in flat]
        rest_flat = jax.tree_util.tree_flatten_with_path(rest)[0]
        rest_avals = tuple(jax.ShapeDtypeStruct(np.shape(v), v.dtype) for _, v in rest_flat)
        rest_names = tuple("/".join(map(str, path_names(k))) for k, _ in rest_flat)
        return found, rest_avals, rest_names


def is_array(x) -> bool:
    """An array leaf of a pytree model (a value the step stores), not a static one."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


class TreePartition:
    """A model given as a pytree (an Equinox module, dicts of arrays, any pytree): its leaves by
    key path are the parameters (the floating arrays at ``paths``), the rest of its state (its
    other arrays: integer counters, RNG keys) and static values (every leaf that is not an array:
    Python numbers, functions, strings, kept as they are, as ``eqx.partition(model,
    eqx.is_array)`` keeps them). The same interface as ``Partition``, for the same plan.

    Args:
      model: the pytree (concrete, or with ``jax.ShapeDtypeStruct`` leaves).
      paths: the key paths (tuples of names and indices) of the leaves that are parameters.
    """

    def __init__(self, model, paths) -> None:
        self.paths = frozenset(tuple(p) for p in paths)
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(model)
        self.names = [path_names(k) for k, _ in flat]
        self.kinds = [
            "param" if n in self.paths else "rest" if is_array(v) else "static" for n, (_, v) in zip(self.names, flat)
        ]
        self.static = [v if kind == "static" else None for kind, (_, v) in zip(self.kinds, flat)]

    def leaves(self, model) -> list:
        """``model``'s leaves, checked to have the structure this partition was made from."""
        leaves, treedef = jax.tree_util.tree_flatten(model)
        if treedef != self.treedef:
            raise ValueError(
                f"model has the pytree structure {treedef}, but this FSDP plan was built for {self.treedef}"
            )
        return leaves

    def split(self, model):
        """``(None, parameter values, rest values)`` of ``model``, as lists in leaf order."""
        leaves = self.leaves(model)
        pick = lambda kind: [v for k, v in zip(self.kinds, leaves) if k == kind]
        return None, pick("param"), pick("rest")

    def merge(self, values, rest):
        """The model from the parameters' and the rest's values (as ``split`` orders them) and
        the static leaves."""
        values, rest = iter(values), iter(rest)
        leaves = [
            next(values) if k == "param" else next(rest) if k == "rest" else s for k, s in zip(self.kinds, self.static)
        ]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def found(self, model) -> tuple[list, tuple, tuple[str, ...]]:
        """``(path, shape, dtype)`` of each parameter of ``model``, the avals of its other state and
        that state's paths (names joined by ``/``)."""
        leaves = self.leaves(model)
        found, rest_avals, rest_names = [], [], []
        for name, kind, v in zip(self.names, self.kinds, leaves):
            if kind == "param":
                found.append((name, tuple(np.shape(v)), jnp.dtype(v.dtype)))
            elif kind == "rest":
                rest_avals.append(jax.ShapeDtypeStruct(np.shape(v), v.dtype))
                rest_names.append("/".join(map(str, name)))
        return found, tuple(rest_avals), tuple(rest_names)

    def values(self, model) -> tuple[list, list]:
        """The parameters' values and the rest's, in leaf order."""
        _, values, rest = self.split(model)
        return values, rest


def traceable(loss_fn: Callable, partition: Partition, assigned: list | None = None) -> Callable:
    """``(parameter values, rest values, batch) -> (loss_fn's output, rest values after)``: the
    loss as a function of arrays, for tracing.

    Args:
      loss_fn: ``loss_fn(model, batch)``.
      partition: the split of the model's variables into parameters and rest.
      assigned: a list that a trace fills with one bool per parameter: whether the loss
        assigned the variable another value (BatchNorm's statistics, a counter).

    Returns:
      The function, to trace.
    """

    def fn(values, rest, batch):
        model = partition.merge(values, rest)
        out = loss_fn(model, batch)
        _, params_after, after = partition.split(model)
        if assigned is not None:
            assigned[:] = [a is not b for a, b in zip(jax.tree.leaves(params_after), values)]
        return out, jax.tree.leaves(after)

    return fn


def make_plan(
    model: Any,
    mesh,
    *,
    precision: str = "mxfp8",
    scale_rule: str = "rceil",
    tp_axis: str | None = None,
    loss_fn: Callable | None = None,
    example_batch: Any = None,
    precision_by_path=None,
    gemm: str = "dequantized",
    gemm_path: str = "auto",
    trainable: Any = nnx.Param,
    prefetch: int = 1,
    keep_layers: int = 1,
    backward_gemm: str = "auto",
    model_constraints: str = "keep",
    xla_costs: str = "corrected",
    weight_blocks: Any = "1x32",
) -> Plan:
    """The FSDP plan of ``model`` over ``mesh``; the arguments are ``mxfp8_jax.flax.FSDP``'s (its
    docstring says what each means), checked here.

    Returns:
      The ``Plan``. ``TypeError`` / ``ValueError`` name the argument and the rule it breaks; a
      model without a unit is a ``ValueError`` listing the parameters found.
    """
    tree = not isinstance(model, nnx.Module)
    if tree and not any(is_array(leaf) for leaf in jax.tree.leaves(model)):
        raise TypeError(f"model must be a flax.nnx.Module or a pytree of arrays, got {type(model).__name__}")
    topology = Topology.of(mesh, tp_axis)
    _check_options(precision, loss_fn, example_batch, precision_by_path, prefetch, model_constraints, xla_costs)
    if isinstance(keep_layers, bool) or not isinstance(keep_layers, int) or keep_layers < 0:
        raise ValueError(
            f"keep_layers={keep_layers!r} must be an int >= 0 (a remat scan's last layers whose forward-gathered "
            "weights serve their backward; 0: only the first weights the forward prefetched)"
        )
    check_blocks(weight_blocks)
    jaxprs.warn_if_untested()
    scale = ScaleRule.parse(scale_rule).value
    mode = mxfp8_gemm.check_mode(gemm, gemm_path, scale_rule, topology.platform, topology.capability)
    if tree:
        _check_tree(model, loss_fn, tp_axis)
        trained_paths, params_paths, candidates, loose = _select_leaves(model, trainable)
        partition = TreePartition(model, params_paths)
    else:
        trained_paths, params_paths, candidates, loose = _select(model, trainable, traced=loss_fn is not None)
        partition = Partition(model, params_paths | candidates)
    found, rest_avals, rest_names = partition.found(model)
    constraints = ()
    if loss_fn is None:
        uses = uses_from_layers(found, _unit_kernels(model))
    else:
        topology.check_batch(example_batch, "example_batch")
        batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), dtype_of(a)), example_batch)
        assigned: list[bool] = []
        uses, closed = _uses(loss_fn, partition, found, rest_avals, batch, topology, assigned)
        kept = _read_as_weights(found, uses, assigned, trainable, loose, candidates)
        if kept != candidates:  # the other candidates are the model's other state: plan without them
            partition = Partition(model, params_paths | kept)
            found, rest_avals, rest_names = partition.found(model)
            uses, closed = _uses(loss_fn, partition, found, rest_avals, batch, topology)
        constraints = _constraints(closed, len(found) + len(rest_avals), batch, topology, model_constraints)
    params = plan_from_uses(
        found,
        uses,
        topology,
        precision=precision,
        rule=precision_by_path,
        tp_roles={} if tree else _tp_roles(model),
        frozen=frozenset(j for j, (path, _, _) in enumerate(found) if path not in trained_paths),
    )
    check_rule_matches(precision_by_path, [p.name for p in params])
    params = with_blocks(params, weight_blocks)
    plan = Plan(
        params,
        topology,
        precision,
        scale,
        Gemms(backward_gemm, mode),
        partition,
        rest_avals,
        rest_names,
        example_tree=None if loss_fn is None else jax.tree.structure(example_batch),
        prefetch=prefetch,
        keep_layers=keep_layers,
        traced=loss_fn is not None,
        trainable=trainable,
        precision_by_path=precision_by_path,
        weight_blocks=weight_blocks,
        constraints=constraints,
        model_constraints=model_constraints,
        xla_costs=xla_costs,
    )
    if not plan.units:
        raise _no_unit(plan)
    return plan


def values_of(plan: Plan, model) -> tuple[list, list]:
    """The values of ``model``'s parameters (in the plan's order) and of its other state.

    Raises:
      TypeError: ``model`` is not an ``nnx.Module`` where the plan was built for one.
      ValueError: its parameters' paths and shapes, its pytree structure, or the count of its
        other state's values, are not those the plan was built for.
    """
    found, rest_avals, _ = plan.partition.found(model)
    found = tuple((tuple(path), shape) for path, shape, _ in found)
    want = tuple((p.path, p.shape) for p in plan.params)
    if found != want:
        raise ValueError(f"model has parameters {found}, but this FSDP plan was built for {want}")
    if len(rest_avals) != len(plan.rest_avals):
        raise ValueError(
            f"model has {len(rest_avals)} values of state other than the plan's parameters, the plan "
            f"{len(plan.rest_avals)}"
        )
    return plan.partition.values(model)


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


def path_names(path) -> tuple[str | int, ...]:
    """A jax key path as plain names and indices."""
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _check_options(
    precision, loss_fn, example_batch, precision_by_path, prefetch, model_constraints, xla_costs
) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")
    if (loss_fn is None) != (example_batch is None):
        raise ValueError(
            "loss_fn and example_batch go together: the plan traces loss_fn(model, example_batch) "
            "to find the parameters GEMMs and lookups read (give both, or neither for units by layer class)"
        )
    check_rule(precision_by_path)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r} must be an int >= 0 (layers ahead; 0: each gather waits for its op)")
    if model_constraints not in MODEL_CONSTRAINTS:
        raise ValueError(f"model_constraints={model_constraints!r} must be one of {MODEL_CONSTRAINTS}")
    if xla_costs not in XLA_COSTS:
        raise ValueError(f"xla_costs={xla_costs!r} must be one of {XLA_COSTS}")


def _uses(loss_fn, partition: Partition, found, rest_avals, batch, topology: Topology, assigned=None):
    """How the loss reads each parameter of ``partition``, from a trace on ``batch``: the
    ``Uses`` and the traced jaxpr."""
    avals = [jax.ShapeDtypeStruct(shape, dtype) for _, shape, dtype in found]
    fn = traceable(loss_fn, partition, assigned)
    closed, out_shape = trace(fn, avals, list(rest_avals), batch, forbidden=topology.fsdp_axis_sizes)
    check_loss_shape(out_shape[0])
    return analyse(closed, len(avals)), closed


def _constraints(closed, num_state: int, batch, topology: Topology, mode: str) -> tuple:
    """The model's sharding constraints in the traced loss that replicate what the batch split
    reaches; a ``"keep"`` plan warns once, naming the first and what they cost."""
    specs = [None] * num_state
    specs += [fsdp_specs.batch_leaf_spec(np.ndim(x), (topology.fsdp_axes,)) for x in jax.tree.leaves(batch)]
    found = fsdp_specs.find_constraints(closed, specs, topology.sizes)
    if found and mode == "keep":
        warnings.warn(constraints_line(found, mode), ModelConstraintWarning, stacklevel=4)
    return found


def _no_unit(plan: Plan) -> ValueError:
    why = (
        "the loss contracts no parameter in a GEMM and looks none up"
        if plan.traced
        else "without an example batch FSDP keeps as units the kernels of flax.nnx.Linear (default dot_general) "
        f"and mxfp8_jax.flax.Linear layers whose in and out features are both multiples of {BLOCK}; give "
        "loss_fn= and example_batch= to find units by operation"
    )
    return ValueError(
        f"model has no eligible weight: {why}; parameters found: {[(p.name, p.shape) for p in plan.params]}"
    )


def _select(model: nnx.Module, trainable, *, traced: bool) -> tuple[frozenset, frozenset, frozenset, frozenset]:
    """``(trained, parameters, candidates, variables)``: the paths of the floating variables
    ``trainable`` matches; of those and every ``nnx.Param``; of the other floating variables,
    which a traced loss may read as frozen weights (none without a trace); of the trained ones
    that are not ``nnx.Param``s."""
    try:
        filterlib.to_predicate(trainable)
    except (TypeError, ValueError):
        raise TypeError(
            f"trainable={trainable!r} is not an nnx filter (a Variable type such as nnx.LoRAParam, a tuple of "
            f"filters, nnx.Any(...), or a predicate (path, variable) -> bool)"
        ) from None
    floating = lambda v: jnp.issubdtype(v.get_value().dtype, jnp.floating)
    variables = [(tuple(path), v) for path, v in nnx.to_flat_state(nnx.state(model))]
    matched = {tuple(path) for path, _ in nnx.to_flat_state(nnx.state(model, trainable))}
    trained = frozenset(path for path, v in variables if path in matched and floating(v))
    if not trained:
        shown = sorted({type(v).__name__ for _, v in variables if floating(v)})
        raise ValueError(
            f"trainable={trainable!r} matches no floating variable of the model, so the optimizer would train "
            f"nothing; the model's floating variables are of the types {shown} (give the filter "
            "nnx.Optimizer(wrt=) would take: nnx.Param, nnx.LoRAParam, ...)"
        )
    params = trained | {path for path, v in variables if isinstance(v, nnx.Param)}
    candidates = frozenset(path for path, v in variables if traced and path not in params and floating(v))
    loose = frozenset(path for path, v in variables if path in trained and not isinstance(v, nnx.Param))
    return trained, frozenset(params), candidates, loose


def _check_tree(model, loss_fn, tp_axis) -> None:
    """A pytree model's plan needs the loss traced (no layer classes to go by) and takes no
    tensor parallelism (which layers mark, in NNX)."""
    if loss_fn is None:
        raise ValueError(
            f"a {type(model).__name__} model (a pytree, not an nnx.Module) needs loss_fn= and example_batch=: "
            "its units are found by tracing loss_fn(model, example_batch)"
        )
    if tp_axis is not None:
        raise NotImplementedError(
            "tp_axis= needs the tensor-parallel layers marked (mxfp8_jax.flax.tensor_parallel on NNX layers); "
            "a pytree model trains with FSDP over every mesh axis"
        )


def _select_leaves(model, trainable) -> tuple[frozenset, frozenset, frozenset, frozenset]:
    """``(trained, parameters, (), ())`` for a pytree model: the key paths of its floating array
    leaves, and of those the ones ``trainable`` takes (``nnx.Param``, the default: all of them;
    or a predicate ``(path, leaf) -> bool``, the path a tuple of names and indices)."""
    flat = jax.tree_util.tree_flatten_with_path(model)[0]
    params = [(path_names(k), v) for k, v in flat if is_array(v) and jnp.issubdtype(v.dtype, jnp.floating)]
    if trainable is nnx.Param:
        trained = [path for path, _ in params]
    elif callable(trainable) and not isinstance(trainable, type):
        trained = [path for path, v in params if trainable(path, v)]
    else:
        raise TypeError(
            f"trainable={trainable!r}: for a pytree model, a predicate (path, leaf) -> bool (path a tuple of "
            "names and indices), or leave it out to train every floating array"
        )
    if not trained:
        raise ValueError(
            f"trainable={trainable!r} takes no floating array leaf of the model, so the optimizer would train "
            f"nothing; its floating leaves: {['/'.join(map(str, p)) for p, _ in params][:8]}"
        )
    return frozenset(trained), frozenset(path for path, _ in params), frozenset(), frozenset()


def _read_as_weights(found, uses, assigned, trainable, variables: frozenset, candidates: frozenset) -> frozenset:
    """The ``candidates`` (traced as parameters) that a GEMM or lookup of the loss reads and that
    the loss does not assign: frozen weights. A trained variable other than an ``nnx.Param``
    (in ``variables``) that the loss assigns is model state, not a weight: a ``ValueError``."""
    kept = set()
    for j, (path, _, _) in enumerate(found):
        path = tuple(path)
        if path in variables and assigned[j]:
            raise ValueError(
                f"trainable={trainable!r} matches {'/'.join(map(str, path))}, which the loss assigns (model state "
                "such as BatchNorm's statistics, updated by the forward pass, not by the optimizer); leave it out "
                "of the trainable filter"
            )
        if path in candidates and not assigned[j] and any(u.kind in ("gemm", "lookup") for u in uses.by_param[j]):
            kept.add(path)
    return frozenset(kept)


def _unit_kernels(model: nnx.Module) -> dict[tuple, tuple[tuple[int, ...], int, int]]:
    """Kernel path -> ``(stack, in, out)`` for every layer whose kernel is a unit by class."""
    found = {}
    for path, node in nnx.iter_graph(model):
        kernel = getattr(node, "kernel", None) if isinstance(node, nnx.Module) else None
        if not isinstance(kernel, nnx.Variable):
            continue
        spec = unit_kernel_shape(node, tuple(kernel.get_value().shape))
        if spec is not None and jnp.issubdtype(kernel.get_value().dtype, jnp.floating):
            found[(*tuple(path), "kernel")] = spec
    return found


def _tp_roles(model: nnx.Module) -> dict[tuple, str]:
    """Kernel path -> tensor-parallel role, for the layers ``tensor_parallel`` marked."""
    roles = {}
    for path, node in nnx.iter_graph(model):
        role = getattr(node, "tensor_parallel", None) if isinstance(node, nnx.Module) else None
        if role is not None and isinstance(getattr(node, "kernel", None), nnx.Variable):
            roles[(*tuple(path), "kernel")] = role
    return roles
