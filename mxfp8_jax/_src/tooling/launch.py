"""Local multi-process runs: N Python processes on 127.0.0.1, one JAX distributed job.

Used by ``mxfp8-jax demo --processes N`` (``demo.run_in_processes``) and by the multi-process
tests (tests/multiproc.py).

    results = launch("mypkg.mod:fn", 2, args=(...), devices_per_process=4, timeout=120)

Each process runs this module as a worker: it sets JAX up for CPU (``devices_per_process``
simulated devices, cross-process collectives through gloo: ``jax_cpu_collectives_implementation``),
calls ``jax.distributed.initialize(coordinator_address="127.0.0.1:PORT", num_processes=N,
process_id=i)`` with a free port, starts the backends (``jax.devices()`` then lists all
``N * devices_per_process`` devices, ``jax.local_devices()`` this process's), and calls the
target with ``args``. The target's return value (JSON-serializable) comes back as
``ProcessResult.result``.

``target`` is ``"package.module:function"`` or ``"path/to/file.py:function"``; ``args`` are
JSON-serializable positional arguments, the same for every process (a target reads
``jax.process_index()`` for its rank).

Every wait is bounded: the processes get ``timeout`` seconds in all; when one fails the others
get ``grace`` seconds more (they may be blocked in a collective with it) and are then killed.
All processes (and anything they started in their session) are killed before ``launch``
returns, whatever happens. Output is captured per process (``stdout``, ``stderr``), except the
stdout of process ``echo`` when given, which is copied to this process's stdout as it comes
(without gloo's ``[Gloo]`` connection lines).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

_SPEC_ENV = "MXFP8_LAUNCH_SPEC"


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    """One process of a ``launch``: exit code (None: killed at the deadline), captured output,
    and the target's JSON-decoded return value (None if it did not return)."""

    process_id: int
    returncode: int | None
    stdout: str
    stderr: str
    result: Any = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class LaunchError(RuntimeError):
    """A process failed or ran past the deadline; ``results`` holds every process's outcome."""

    def __init__(self, message: str, results: list[ProcessResult]):
        super().__init__(message)
        self.results = results


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    target: str,
    num_processes: int,
    *,
    args: Sequence[Any] = (),
    devices_per_process: int = 4,
    timeout: float = 120.0,
    grace: float = 10.0,
    env: Mapping[str, str] | None = None,
    echo: int | None = None,
    check: bool = True,
) -> list[ProcessResult]:
    """Runs ``target(*args)`` in ``num_processes`` local processes of one JAX distributed job.

    Returns one ``ProcessResult`` per process, by process id. With ``check`` (default), raises
    ``LaunchError`` (its message has each failed process's output tail) when a process fails
    or the deadline passes. ``env`` adds environment variables to the processes'.
    """
    if not isinstance(target, str) or ":" not in target:
        raise ValueError(f"target={target!r} must be 'package.module:function' or 'path/file.py:function'")
    for name, v in (("num_processes", num_processes), ("devices_per_process", devices_per_process)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be positive (seconds)")
    json.dumps(list(args))  # arguments travel as JSON
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="mxfp8_launch_") as tmp:
        procs, files, pump = [], [], None
        try:
            for i in range(num_processes):
                spec = dict(
                    target=target,
                    args=list(args),
                    coordinator=f"127.0.0.1:{port}",
                    num_processes=num_processes,
                    process_id=i,
                    devices=devices_per_process,
                    init_timeout=max(1, int(timeout)),
                    result=os.path.join(tmp, f"result_{i}.json"),
                )
                child_env = {**os.environ, **(env or {}), _SPEC_ENV: json.dumps(spec), "JAX_PLATFORMS": "cpu"}
                out = subprocess.PIPE if echo == i else open(os.path.join(tmp, f"stdout_{i}"), "w")
                err = open(os.path.join(tmp, f"stderr_{i}"), "w")
                files += [f for f in (out, err) if f is not subprocess.PIPE]
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "mxfp8_jax._src.tooling.launch"],
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=err,
                        env=child_env,
                        start_new_session=True,  # its own process group, killed as one below
                    )
                )
                if echo == i:
                    pump = threading.Thread(target=_echo, args=(procs[-1].stdout,), daemon=True)
                    pump.start()
            codes = _wait(procs, time.monotonic() + timeout, grace)
        finally:
            for p in procs:
                _kill(p)
            if pump is not None:
                pump.join(timeout=10)
            for f in files:
                f.close()
        results = [_collect(tmp, i, codes[i], echo == i) for i in range(num_processes)]
    if check:
        bad = [r for r in results if not r.ok]
        if bad:
            lines = [f"{len(bad)} of {num_processes} processes failed (timeout {timeout} s):"]
            for r in bad:
                state = "killed (still running)" if r.returncode is None else f"exit code {r.returncode}"
                lines.append(f"--- process {r.process_id}: {state}; stderr tail:\n{r.stderr[-3000:]}")
            raise LaunchError("\n".join(lines), results)
    return results


def _echo(stream) -> None:
    """Copies a process's stdout here line by line, without gloo's connection chatter."""
    for line in iter(stream.readline, b""):
        if not line.startswith(b"[Gloo]"):
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
    stream.close()


def _wait(procs, deadline: float, grace: float) -> list[int | None]:
    """Exit codes; once one process fails the rest get ``grace`` seconds at most."""
    codes: list[int | None] = [None] * len(procs)
    while time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if codes[i] is None:
                codes[i] = p.poll()
        if all(c is not None for c in codes):
            break
        if any(c not in (None, 0) for c in codes):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.05)
    return codes


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            p.kill()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not hang
        pass


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _collect(tmp: str, i: int, code, echoed: bool) -> ProcessResult:
    result = None
    raw = _read(os.path.join(tmp, f"result_{i}.json"))
    if raw:
        result = json.loads(raw)["value"]
    stdout = "" if echoed else _read(os.path.join(tmp, f"stdout_{i}"))
    return ProcessResult(i, code, stdout, _read(os.path.join(tmp, f"stderr_{i}")), result)


# ------------------------------------------------------------------------------------------------
# The worker (``python -m mxfp8_jax._src.tooling.launch`` with the spec in the environment)


def _resolve(target: str):
    where, name = target.rsplit(":", 1)
    if where.endswith(".py"):
        mod_name = f"_mxfp8_launch_target_{os.path.splitext(os.path.basename(where))[0]}"
        spec = importlib.util.spec_from_file_location(mod_name, where)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {where}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


def initialize_cpu(coordinator: str, num_processes: int, process_id: int, devices: int, timeout: int = 300) -> None:
    """This process's part of a CPU distributed job: ``devices`` local CPU devices, gloo
    collectives, ``jax.distributed.initialize``, backends started. Call before any other JAX use."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout,
    )
    jax.devices()  # start the backends now, with this process's device count


def _worker() -> int:
    spec = json.loads(os.environ[_SPEC_ENV])
    initialize_cpu(
        spec["coordinator"], spec["num_processes"], spec["process_id"], spec["devices"], spec["init_timeout"]
    )
    try:
        value = _resolve(spec["target"])(*spec["args"])
        with open(spec["result"] + ".tmp", "w") as f:
            json.dump({"value": value}, f)
        os.replace(spec["result"] + ".tmp", spec["result"])
    except BaseException:  # noqa: BLE001 - any failure: report it and leave at once
        # Exit now: jax's exit hook would wait for the other processes at a shutdown barrier.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    import jax

    jax.distributed.shutdown()  # a barrier: no process leaves while another still needs the service
    return 0


if __name__ == "__main__":
    sys.exit(_worker())
