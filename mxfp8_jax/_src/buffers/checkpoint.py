"""Logical checkpoints: named tensors written and read shard by shard, on orbax-checkpoint.

A checkpoint is a directory that orbax writes (a composite of two items):

- ``tensors``: one array per tensor, written by orbax's array handler: every process writes the
  shards it addresses (one copy of replicated shards), so no host ever holds a whole tensor;
- ``info``: JSON with the format name and version, each tensor's name (a ``/``-joined model
  path), shape and dtype, and the caller's metadata (scale rule, precision, step, ...).

What is stored is LOGICAL: a tensor's name, shape and values, never a mesh, placements or a
flat buffer's layout, so a checkpoint restores onto any mesh and layout (docs/design.md §3).
``restore_logical`` checks every name, shape and dtype against the caller's targets before any
data moves, and raises one ``ValueError`` naming each parameter path that does not fit: never a
silent permutation (tensors are found by name), truncation or zero fill.

This module knows nothing of flat buffers: ``DBuffer.save``/``restore`` and
``QuantizedDBuffer.save``/``restore`` (which stores the master weights and recomputes the MXFP8
planes on restore) are built on these primitives, with the conversion between a flat buffer and
its logical tensors running on the devices (``logical.unpack_logical``, ``logical.pack_logical``).

Multi-process runs: every process makes the same call with the same directory (orbax
coordinates the processes through ``jax.distributed``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = "mxfp8_jax.logical_checkpoint"
VERSION = 1
_TENSORS, _INFO = "tensors", "info"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: its name (model path), shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """What ``read_metadata`` returns: the tensors (in saved order) and the caller's metadata."""

    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, Any]
    version: int = VERSION

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    def __getitem__(self, name: str) -> TensorInfo:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


class SaveHandle:
    """A save in progress (``async_save=True``) or done: ``wait()`` blocks until every file is
    written and committed, then releases the checkpointer; it is safe to call more than once.
    Also a context manager (waits on exit)."""

    def __init__(self, checkpointer, directory: str):
        self._ckptr = checkpointer
        self.directory = directory

    def wait(self) -> None:
        if self._ckptr is not None:
            ckptr, self._ckptr = self._ckptr, None
            try:
                if hasattr(ckptr, "wait_until_finished"):
                    ckptr.wait_until_finished()
            finally:
                ckptr.close()

    @property
    def done(self) -> bool:
        return self._ckptr is None

    def __enter__(self) -> SaveHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.wait()


# ------------------------------------------------------------------------------------------------
# The logical primitives


def save_logical(
    directory,
    tensors: Mapping[str, jax.Array],
    metadata: Mapping[str, Any] | None = None,
    *,
    async_save: bool = False,
    overwrite: bool = False,
) -> SaveHandle:
    """Writes ``tensors`` (name -> global ``jax.Array``, any sharding) and ``metadata`` to ``directory``.

    Names are ``/``-joined parameter paths (any non-empty strings); ``metadata`` must be JSON
    serializable. ``directory`` must not exist unless ``overwrite``. With ``async_save`` the
    call returns once the device buffers are copied out and the files are written in the
    background; call ``wait()`` on the handle before relying on the checkpoint (or exiting).
    Every process of a multi-process run must make the call.
    """
    import orbax.checkpoint as ocp

    directory = as_path(directory)
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a mapping of name -> jax.Array, got {type(tensors).__name__}")
    entries, tree = [], {}
    for j, (name, value) in enumerate(tensors.items()):
        _check_name(name)
        if not isinstance(value, jax.Array):
            raise TypeError(f"tensors[{name!r}] must be a jax.Array (any sharding), got {type(value).__name__}")
        key = f"t{j:06d}"
        tree[key] = value
        entries.append(dict(name=name, key=key, shape=list(value.shape), dtype=jnp.dtype(value.dtype).name))
    meta = {} if metadata is None else metadata
    if not isinstance(meta, Mapping):
        raise TypeError(f"metadata must be a mapping (JSON object), got {type(meta).__name__}")
    try:
        json.dumps(dict(meta))
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON serializable: {e}") from None
    info = dict(format=FORMAT, version=VERSION, tensors=entries, metadata=dict(meta))
    handler = ocp.CompositeCheckpointHandler()
    ckptr = ocp.AsyncCheckpointer(handler) if async_save else ocp.Checkpointer(handler)
    args = ocp.args.Composite(**{_TENSORS: ocp.args.StandardSave(tree), _INFO: ocp.args.JsonSave(info)})
    try:
        ckptr.save(directory, args=args, force=bool(overwrite))
    except BaseException:
        ckptr.close()
        raise
    handle = SaveHandle(ckptr, directory)
    if not async_save:
        handle.wait()
    return handle


def read_metadata(directory) -> CheckpointInfo:
    """The names, shapes, dtypes and caller metadata of a checkpoint, without reading tensor data."""
    import orbax.checkpoint as ocp

    directory = as_path(directory)
    if not os.path.isdir(os.path.join(directory, _INFO)):
        raise ValueError(f"{directory} is not an mxfp8_jax logical checkpoint (no {_INFO!r} item)")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        raw = ckptr.restore(directory, args=ocp.args.Composite(**{_INFO: ocp.args.JsonRestore()}))[_INFO]
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"{directory} is not an mxfp8_jax logical checkpoint (format {raw.get('format')!r})")
    if raw.get("version") != VERSION:
        raise ValueError(f"{directory}: checkpoint format version {raw.get('version')} is not supported ({VERSION})")
    tensors = tuple(
        TensorInfo(e["name"], tuple(int(d) for d in e["shape"]), jnp.dtype(e["dtype"])) for e in raw["tensors"]
    )
    return CheckpointInfo(tensors, dict(raw.get("metadata", {})), int(raw["version"]))


def check_names(info: CheckpointInfo, names, *, where: str = "") -> None:
    """Raises a ``ValueError`` listing the names missing from the checkpoint and the stored
    names missing from ``names`` (a renamed parameter shows up in both lists)."""
    _raise(_name_problems(info, names), where)


def check_targets(info: CheckpointInfo, targets: Mapping[str, Any], *, where: str = "") -> None:
    """Raises one ``ValueError`` listing every path that does not fit: names missing from the
    checkpoint or from ``targets``, and shape or dtype differences (``targets`` values have
    ``.shape`` and ``.dtype``)."""
    problems = _name_problems(info, targets)
    stored = {t.name: t for t in info.tensors}
    for name, t in targets.items():
        s = stored.get(name)
        if s is None:
            continue
        shape, dtype = tuple(int(d) for d in t.shape), jnp.dtype(t.dtype)
        if shape != s.shape:
            problems.append(f"{name!r}: stored shape {s.shape}, target shape {shape}")
        elif dtype != s.dtype:
            problems.append(f"{name!r}: stored dtype {s.dtype.name}, target dtype {dtype.name}")
    _raise(problems, where)


def _name_problems(info: CheckpointInfo, names) -> list[str]:
    stored, wanted = info.names, list(names)
    missing = [n for n in wanted if n not in stored]
    extra = [n for n in stored if n not in wanted]
    problems = []
    if missing:
        problems.append(f"not in the checkpoint: {', '.join(map(repr, missing))}")
    if extra:
        problems.append(f"in the checkpoint but not in the targets: {', '.join(map(repr, extra))}")
    return problems


def _raise(problems: list[str], where: str) -> None:
    if problems:
        head = f"checkpoint {where} does not fit the targets" if where else "checkpoint does not fit the targets"
        raise ValueError(head + ":\n  " + "\n  ".join(problems))


def restore_logical(directory, targets: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """The named tensors of a checkpoint, each read shard by shard into ``targets[name].sharding``.

    ``targets`` maps every stored name to a ``jax.ShapeDtypeStruct`` with a ``sharding``; the
    names, shapes and dtypes must match the checkpoint exactly (``check_targets``, before any
    data is read). Returns ``{name: jax.Array}`` in ``targets`` order.
    """
    import orbax.checkpoint as ocp

    directory = as_path(directory)
    if not isinstance(targets, Mapping):
        raise TypeError(f"targets must be a mapping of name -> jax.ShapeDtypeStruct, got {type(targets).__name__}")
    for name, t in targets.items():
        if not isinstance(getattr(t, "sharding", None), jax.sharding.Sharding):
            raise TypeError(f"targets[{name!r}] must be a jax.ShapeDtypeStruct with a sharding, got {t!r}")
    info = read_metadata(directory)
    check_targets(info, targets, where=directory)
    keys = {e.name: f"t{j:06d}" for j, e in enumerate(info.tensors)}
    abstract = {
        keys[n]: jax.ShapeDtypeStruct(tuple(t.shape), jnp.dtype(t.dtype), sharding=t.sharding)
        for n, t in targets.items()
    }
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        tree = ckptr.restore(directory, args=ocp.args.Composite(**{_TENSORS: ocp.args.StandardRestore(abstract)}))
    tree = tree[_TENSORS]
    return {n: tree[keys[n]] for n in targets}


# ------------------------------------------------------------------------------------------------
# Helpers


def as_path(directory) -> str:
    """``directory`` (a string or path-like) as an absolute path string."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    return os.path.abspath(os.fspath(directory))


def _check_name(name) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"tensor names must be non-empty strings, got {name!r}")


def tensor_names(names, n: int | None) -> tuple[str, ...]:
    """``names`` checked (unique non-empty strings, ``n`` of them when ``n`` is given), or
    ``"0"``, ``"1"``, ... for ``n`` tensors when ``names`` is None."""
    if names is None:
        return tuple(str(i) for i in range(n))
    if isinstance(names, str):
        raise TypeError(f"names must be a sequence of strings, got the string {names!r}")
    names = tuple(names)
    for name in names:
        _check_name(name)
    if len(set(names)) != len(names):
        dup = sorted({x for x in names if names.count(x) > 1})
        raise ValueError(f"names must be unique; repeated: {dup}")
    if n is not None and len(names) != n:
        raise ValueError(f"names has {len(names)} entries for {n} tensors")
    return names
