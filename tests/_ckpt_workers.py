"""Functions the multi-process checkpoint test runs in each process (tests/multiproc.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ckpt_values import device_tensor

SHAPES = [(64, 32), (96, 32), (40, 8)]
NAMES = ["blocks/0/w", "blocks/1/w", "head/b"]


def distribute_and_save(directory: str) -> dict:
    """Tensors made sharded over all processes' devices, packed UNPADDED with no host gather,
    saved logically; returns what each process saw."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from mxfp8_jax._src.buffers import placement as pl
    from mxfp8_jax._src.buffers.dbuffer import DBuffer
    from mxfp8_jax._src.buffers.layout import ShardLayout

    mesh = jax.make_mesh((2, 4), ("a", "b"))
    # Rows over "a" for the first, over both axes for the others: each spans both processes.
    specs = [PartitionSpec("a"), PartitionSpec(("a", "b")), PartitionSpec("b")]
    tensors = [device_tensor(s, t, NamedSharding(mesh, spec)) for t, (s, spec) in enumerate(zip(SHAPES, specs))]
    flat_mesh = jax.make_mesh((8,), ("x",))
    with jax.transfer_guard("disallow"):
        buf = DBuffer.distribute_tensors(tensors, flat_mesh, [pl.RowAtomic()], shard_layout=ShardLayout.UNPADDED)
    buf.save(directory, names=NAMES, metadata={"step": 7})
    return dict(
        process=jax.process_index(),
        devices=jax.device_count(),
        local_devices=jax.local_device_count(),
        inputs_fully_addressable=[t.is_fully_addressable for t in tensors],
        buffer_fully_addressable=buf.data.is_fully_addressable,
        physical_size=buf.layout.physical_size,
    )


def restore_and_check(directory: str) -> dict:
    """A checkpoint saved by one process restored onto (2, 4) over both processes, PADDED; each
    process checks the shards it holds against the formula (numpy) and returns the verdicts."""
    import jax
    import numpy as np

    from mxfp8_jax._src.buffers import placement as pl
    from mxfp8_jax._src.buffers.dbuffer import DBuffer
    from mxfp8_jax._src.buffers.layout import ShardLayout

    from ckpt_values import host_tensor

    mesh = jax.make_mesh((2, 4), ("a", "b"))
    buf = DBuffer.restore(
        directory, mesh, [pl.Replicate(), pl.RowAtomic()], names=NAMES, shard_layout=ShardLayout.PADDED
    )
    checked, equal = 0, True
    for t, (x, shape) in enumerate(zip(buf.logical_tensors(), SHAPES)):
        want = host_tensor(shape, t)
        for shard in x.addressable_shards:
            got = np.asarray(shard.data)
            equal &= bool((got.view(np.uint8) == want[shard.index].view(np.uint8)).all())
            checked += got.size
    return dict(process=jax.process_index(), elements_checked=checked, equal=equal)


def save_then_restore(save_dir: str, restore_dir: str) -> dict:
    return dict(saved=distribute_and_save(save_dir), restored=restore_and_check(restore_dir))
