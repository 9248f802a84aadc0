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

On top of these primitives: ``save_dbuffer``/``restore_dbuffer`` (``DBuffer.save``/``restore``)
and ``save_quantized``/``restore_quantized`` (``QuantizedDBuffer.save``/``restore``: the master
weights are stored, the MXFP8 planes are recomputed from them on restore). The conversion
between a flat buffer and its logical tensors runs on the devices (``dbuffer.unpack_logical``,
``dbuffer.pack_logical``).

Multi-process runs: every process makes the same call with the same directory (orbax
coordinates the processes through ``jax.distributed``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mxfp8_jax._src import placement as pl
from mxfp8_jax._src.dbuffer import DBuffer, logical_sharding, pack_logical
from mxfp8_jax._src.dbuffer import _build_layout as build_layout
from mxfp8_jax._src.layout import GlobalLayout, ShardLayout

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

    directory = _path(directory)
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

    directory = _path(directory)
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

    directory = _path(directory)
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
# DBuffer and QuantizedDBuffer


def save_dbuffer(
    directory,
    buf: DBuffer,
    *,
    names: Sequence[str] | None = None,
    metadata: Mapping[str, Any] | None = None,
    async_save: bool = False,
    overwrite: bool = False,
) -> SaveHandle:
    """Saves ``buf``'s logical tensors under ``names`` (default ``"0"``, ``"1"``, ...).

    The value is saved (Partial axes reduced); the mesh, placements and layout are not. The
    caller's ``metadata`` is stored beside ``{"kind": "DBuffer"}`` under ``"user"``.
    """
    if not isinstance(buf, DBuffer):
        raise TypeError(f"buf must be a DBuffer, got {type(buf).__name__}")
    names = _names(names, buf.layout.num_tensors)
    tensors = dict(zip(names, buf.logical_tensors()))
    meta = dict(kind="DBuffer", user=dict(metadata or {}))
    return save_logical(directory, tensors, meta, async_save=async_save, overwrite=overwrite)


def restore_dbuffer(
    directory,
    mesh: Mesh,
    placements: pl.Placements,
    *,
    names: Sequence[str] | None = None,
    layout: GlobalLayout | None = None,
    shard_layout: ShardLayout = ShardLayout.PADDED,
    block_size: int = 1,
    dtype=None,
) -> DBuffer:
    """A ``DBuffer`` over ``mesh``/``placements`` holding the checkpoint's tensors, by name.

    ``names`` (default: the checkpoint's, in saved order) fixes the tensor order of the new
    buffer and must be exactly the stored names; ``layout`` (or ``shard_layout``/``block_size``)
    fixes its packing, on any mesh. ``dtype`` (default: the stored one) casts on the devices.
    """
    info = read_metadata(directory)
    names = info.names if names is None else _names(names, None)
    check_names(info, names, where=_path(directory))
    shapes = [info[n].shape for n in names]
    stored = {info[n].dtype for n in names}
    if len(stored) > 1:
        raise ValueError(f"the checkpoint's tensors have several dtypes {sorted(d.name for d in stored)}")
    src = stored.pop() if stored else jnp.dtype(jnp.float32)
    placements = pl.validate_placements(mesh, placements)
    if layout is None:
        layout = build_layout(mesh, placements, shapes, shard_layout, block_size)
    elif tuple(shapes) != layout.tensor_shapes:
        bad = [f"{n!r}: stored {s}, layout {ls}" for n, s, ls in zip(names, shapes, layout.tensor_shapes) if s != ls]
        raise ValueError("layout.tensor_shapes differ from the checkpoint's: " + "; ".join(bad))
    base = tuple(pl.Replicate() if pl.is_partial(p) else p for p in placements)
    targets = {n: jax.ShapeDtypeStruct(s, src, sharding=logical_sharding(mesh, base, s)) for n, s in zip(names, shapes)}
    arrays = restore_logical(directory, targets)
    flat = pack_logical([arrays[n] for n in names], mesh, base, layout, src if dtype is None else dtype)
    return DBuffer(flat, mesh, base, layout).redistribute(placements)


def save_quantized(
    directory,
    qbuf,
    master: DBuffer,
    *,
    scale_rule: str = "rceil",
    names: Sequence[str] | None = None,
    metadata: Mapping[str, Any] | None = None,
    async_save: bool = False,
    overwrite: bool = False,
) -> SaveHandle:
    """Saves a ``QuantizedDBuffer`` by its master weights ``master`` (same mesh and layout): the
    MXFP8 planes are not stored; ``scale_rule`` and the allocated directions are, and
    ``restore_quantized`` recomputes the planes from the restored master."""
    from mxfp8_jax._src import format as fmt
    from mxfp8_jax._src.quantized import QuantizedDBuffer

    if not isinstance(qbuf, QuantizedDBuffer):
        raise TypeError(f"qbuf must be a QuantizedDBuffer, got {type(qbuf).__name__}")
    if not isinstance(master, DBuffer):
        raise TypeError(f"master must be a DBuffer, got {type(master).__name__}")
    if master.layout != qbuf.layout or master.mesh != qbuf.mesh:
        raise ValueError("master must have the QuantizedDBuffer's mesh and layout (the weights it was quantized from)")
    rule = fmt.ScaleRule.parse(scale_rule)
    names = _names(names, qbuf.layout.num_tensors)
    meta = dict(
        kind="QuantizedDBuffer",
        scale_rule=rule.value,
        rowwise=qbuf.is_rowwise_allocated,
        columnwise=qbuf.is_columnwise_allocated,
        user=dict(metadata or {}),
    )
    tensors = dict(zip(names, master.logical_tensors()))
    return save_logical(directory, tensors, meta, async_save=async_save, overwrite=overwrite)


def restore_quantized(
    directory,
    mesh: Mesh,
    placements: pl.Placements,
    *,
    names: Sequence[str] | None = None,
    shard_layout: ShardLayout = ShardLayout.PADDED,
    dtype=None,
    backend: str = "auto",
):
    """``(master, qbuf)`` over ``mesh``/``placements``: the master restored (``restore_dbuffer``
    with an MXFP8 layout, ``block_size = 32``) and the planes that were allocated at save time
    quantized from it with the stored scale rule."""
    from mxfp8_jax._src.quantized import QuantizedDBuffer

    info = read_metadata(directory)
    meta = info.metadata
    if meta.get("kind") != "QuantizedDBuffer":
        raise ValueError(f"{directory} holds a {meta.get('kind')!r} checkpoint, not a QuantizedDBuffer's")
    names = info.names if names is None else _names(names, None)
    check_names(info, names, where=_path(directory))
    layout = GlobalLayout.build([info[n].shape for n in names], mesh.size, block_size=32, shard_layout=shard_layout)
    master = restore_dbuffer(directory, mesh, placements, names=names, layout=layout, dtype=dtype)
    qbuf = QuantizedDBuffer.zeros(
        mesh, placements, master.layout, rowwise=bool(meta["rowwise"]), columnwise=bool(meta["columnwise"])
    )
    return master, qbuf.quantize(master, scale_rule=meta["scale_rule"], backend=backend)


# ------------------------------------------------------------------------------------------------
# Helpers


def _path(directory) -> str:
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    return os.path.abspath(os.fspath(directory))


def _check_name(name) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"tensor names must be non-empty strings, got {name!r}")


def _names(names, n: int | None) -> tuple[str, ...]:
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
