"""Multi-process test harness: N processes x D CPU devices on 127.0.0.1 (gloo collectives).

A thin wrapper over ``mxfp8_jax._src.tooling.launch`` (the same spawning as ``mxfp8-jax demo
--processes N``):

    from multiproc import run_processes
    results = run_processes("tests/_ckpt_workers.py:save_sharded", 2, args=[str(tmp_path)])
    results[0].result  # what process 0's function returned (JSON-decoded)

``run_processes(target, num_processes=2, *, args=(), devices_per_process=4, timeout=120,
grace=10, env=None) -> list[ProcessResult]``: ``target`` is ``"path/to/file.py:function"``
(relative paths are taken from the tests folder's parent, the repository root) or
``"package.module:function"``; each process calls ``jax.distributed.initialize`` with a free
port on 127.0.0.1 before the target runs, so the target sees ``jax.devices()`` of all
processes and ``jax.process_index()`` its rank. Every wait is bounded (``timeout`` seconds in
all; ``grace`` more for the others once one fails), every process is killed before the call
returns, and a failure raises ``LaunchError`` carrying each process's stdout/stderr.

The processes run on CPU devices whatever ``MXFP8_TEST_PLATFORM`` says (gloo collectives). Worker
files must not import ``conftest`` (it fixes the pytest process's own devices).
"""

from __future__ import annotations

import os

from mxfp8_jax._src.tooling.launch import LaunchError, ProcessResult, free_port, launch

__all__ = ["LaunchError", "ProcessResult", "free_port", "run_processes"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_processes(
    target: str,
    num_processes: int = 2,
    *,
    args=(),
    devices_per_process: int = 4,
    timeout: float = 120.0,
    grace: float = 10.0,
    env=None,
) -> list[ProcessResult]:
    where, name = target.rsplit(":", 1)
    if where.endswith(".py") and not os.path.isabs(where):
        where = os.path.join(_ROOT, where)
    return launch(
        f"{where}:{name}",
        num_processes,
        args=args,
        devices_per_process=devices_per_process,
        timeout=timeout,
        grace=grace,
        env=env,
    )
