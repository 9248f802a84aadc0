"""The mesh as an FSDP plan sees it: one immutable value, made once and passed everywhere.

A ``Topology`` holds the step's mesh and its tensor-parallel axis (or none) and answers every
question about its geometry: which axes the batch and the units' rows are split over (the FSDP
axes, all but tp), how many devices that is, the ``axis_name`` a collective over them takes, the
``PartitionSpec`` of a batch, and the platform and GPU capability the program is compiled for.
Nothing else in the FSDP package keeps its own copy of these.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from mxfp8_jax._src.core import platforms, spmd


@dataclasses.dataclass(frozen=True)
class Topology:
    """The step's ``mesh`` (its axes automatic: ``shard_map`` does the placing) and ``tp_axis``,
    the mesh axis of tensor parallelism (None: every axis is an FSDP axis).

    Build one with ``Topology.of(mesh, tp_axis)``, which checks the arguments.
    """

    mesh: Mesh
    tp_axis: str | None = None

    @classmethod
    def of(cls, mesh: Mesh, tp_axis: str | None = None) -> Topology:
        """The topology of ``mesh`` (any ``jax.sharding.Mesh``; its axis types are dropped) with
        ``tp_axis`` for tensor parallelism.

        Raises:
          TypeError: ``mesh`` is not a ``Mesh``.
          ValueError: ``tp_axis`` is not an axis of ``mesh``, or the mesh has no other axis.
        """
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        if tp_axis is not None and (tp_axis not in mesh.axis_names or len(mesh.axis_names) < 2):
            raise ValueError(
                f"tp_axis={tp_axis!r} must be one axis of a mesh with at least one other (FSDP) "
                f"axis; the mesh has {tuple(mesh.axis_names)}"
            )
        return cls(Mesh(mesh.devices, mesh.axis_names), tp_axis)

    def check_context(self) -> None:
        """A ``ValueError`` when a mesh is the context (``jax.set_mesh``, as MaxText's trainer
        sets its mesh): the step's ``shard_map`` islands place everything on this mesh
        themselves, and under a context mesh jax traces some of their ops against it and
        refuses them (a plain parameter's island, even with the same mesh)."""
        context = jax.sharding.get_abstract_mesh()
        if context.empty or getattr(context, "manual_axes", ()):
            return
        theirs = dict(zip(context.axis_names, context.axis_sizes))
        raise ValueError(
            f"jax.set_mesh has made a mesh with axes {theirs} the context; FSDP's steps place their values on "
            f"the plan's mesh {dict(self.mesh.shape)} themselves and do not run under a context mesh. Call "
            "FSDP (init, the steps, gather) outside the jax.set_mesh block; a model's own sharding constraints "
            "that name their mesh (NamedSharding(mesh, spec), as MaxText's do) keep working there"
        )

    @property
    def size(self) -> int:
        """Every device of the mesh."""
        return int(self.mesh.size)

    @property
    def sizes(self) -> dict[str, int]:
        """Each mesh axis's size, by name."""
        return dict(self.mesh.shape)

    @property
    def tp_size(self) -> int:
        """The devices of the tp axis (1 without tensor parallelism)."""
        return 1 if self.tp_axis is None else int(self.mesh.shape[self.tp_axis])

    @property
    def fsdp_names(self) -> tuple[str, ...]:
        """The FSDP axes in mesh order: every axis but ``tp_axis``."""
        return tuple(a for a in self.mesh.axis_names if a != self.tp_axis)

    @property
    def fsdp_size(self) -> int:
        """The devices of the FSDP group: those a unit's rows and the batch are split over."""
        return self.size // self.tp_size

    @property
    def axes(self):
        """Every mesh axis as a collective's ``axis_name`` (innermost first)."""
        return spmd.axis_group(self.mesh.axis_names)

    @property
    def fsdp_axes(self):
        """The FSDP axes as a collective's ``axis_name`` and a ``PartitionSpec`` entry
        (innermost first, the order the rows and the batch are split in)."""
        return spmd.axis_group(self.fsdp_names)

    @property
    def fsdp_axis_sizes(self) -> tuple[tuple[str, int], ...]:
        """``(name, size)`` of each FSDP axis, in mesh order: the axes a loss must not name."""
        return tuple((a, int(self.mesh.shape[a])) for a in self.fsdp_names)

    @property
    def batch_spec(self) -> PartitionSpec:
        """How a step's batch is placed: every leaf's leading axis over the FSDP axes (all of
        the mesh without tp) and, under tensor parallelism, its second (sequence) over tp."""
        if self.tp_axis is None:
            return PartitionSpec(self.axes)
        return PartitionSpec(self.fsdp_axes, self.tp_axis)

    def check_batch(self, batch, argname: str = "batch", example_tree=None) -> None:
        """Raises ``ValueError`` unless every leaf of ``batch`` can be split as ``batch_spec``
        says (its leading axis by the FSDP group, its second by tp) and, given ``example_tree``,
        ``batch`` has that structure.

        Args:
          batch: a pytree of arrays or ``jax.ShapeDtypeStruct``s.
          argname: the name the error messages give it.
          example_tree: the structure of the batch the loss was traced on, or None.
        """
        if example_tree is not None and jax.tree.structure(batch) != example_tree:
            raise ValueError(
                f"{argname} has the structure {jax.tree.structure(batch)}, but FSDP traced the loss on an "
                f"example_batch with the structure {example_tree}; a step takes batches shaped like the "
                "example (build FSDP with an example of the batches the steps get)"
            )
        for leaf in jax.tree.leaves(batch):
            shape = np.shape(leaf)
            if len(shape) == 0 or shape[0] % self.fsdp_size:
                raise ValueError(
                    f"{argname} leaf of shape {shape}: its leading (batch) axis must be divisible by the "
                    f"{self.fsdp_size} devices it is split over"
                )
            if self.tp_axis is not None and (len(shape) < 2 or shape[1] % self.tp_size):
                raise ValueError(
                    f"{argname} leaf of shape {shape}: under tp_axis={self.tp_axis!r} its second (sequence) "
                    f"axis is split over {self.tp_size} devices and must be divisible by them"
                )

    @property
    def platform(self) -> str:
        """The platform of the mesh's devices (``"cpu"``, ``"cuda"``, ``"rocm"``)."""
        return platforms.of_mesh(self.mesh)

    @property
    def capability(self):
        """The GPU compute capability of the mesh's devices (None off GPUs or when unknown)."""
        return platforms.of_mesh_capability(self.mesh)
