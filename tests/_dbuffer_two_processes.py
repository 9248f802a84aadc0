"""One of two CPU processes (2 devices each) of test_dbuffer's multi-process check: a DBuffer
whose data is not fully addressable is still checked against its mesh.

Usage: python _dbuffer_two_processes.py PORT PROCESS_ID. Prints one line per case.
"""

import sys

import jax
import numpy as np

port, pid = sys.argv[1], int(sys.argv[2])
jax.config.update("jax_num_cpu_devices", 2)
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)

from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import mxfp8_jax as mx  # noqa: E402

devices = jax.devices()
assert len(devices) == 4 and jax.process_count() == 2, devices
mesh = Mesh(np.array(devices), ("x",))
layout = mx.GlobalLayout.build([(8, 4)], 4)
host = np.arange(layout.physical_size, dtype=np.float32)


def data_on(m):
    return jax.make_array_from_callback(host.shape, NamedSharding(m, PartitionSpec("x")), lambda idx: host[idx])


buf = mx.DBuffer(data_on(mesh), mesh, (mx.RowAtomic(),), layout)
print("ACCEPTED right mesh, fully addressable:", buf.data.is_fully_addressable)
try:
    mx.DBuffer(data_on(Mesh(np.array(devices[::-1]), ("x",))), mesh, (mx.RowAtomic(),), layout)
    print("ACCEPTED reversed mesh")
except ValueError as e:
    print("REFUSED reversed mesh:", e)
jax.distributed.shutdown()
