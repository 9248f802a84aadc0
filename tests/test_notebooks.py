"""Every notebook in notebooks/ runs top to bottom, and the outputs saved in it are current.

Each notebook is executed in a fresh kernel of this Python (nbclient). Its saved outputs must
match the new ones: text outputs equal (memory addresses masked; cells tagged ``measured``, whose
text holds times or XLA's memory accounting, which move with the machine and the jax version, only
need some text), and every saved picture (PNG) must still be
drawn by the same cell, with no error anywhere. Pictures are compared by presence, not by pixels
(fonts and matplotlib versions move pixels).

Regenerate the saved outputs after changing a notebook or the code it shows:

    python tests/test_notebooks.py            # every notebook
    python tests/test_notebooks.py NAME.ipynb # one
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
MAX_TOTAL_BYTES = 2 << 20
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def execute(path: Path, timeout: int = 600):
    """The notebook at ``path`` executed in a new kernel of this interpreter (nothing written)."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "kernels" / "mxfp8-test"
        spec.mkdir(parents=True)
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "test", "language": "python"}))
        km = KernelManager(
            kernel_name="mxfp8-test",
            kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)]),
            transport="ipc",  # local sockets under tmp, not TCP ports
            ip=str(Path(tmp) / "kernel"),
        )
        client = NotebookClient(
            nb, km=km, timeout=timeout, record_timing=False, resources={"metadata": {"path": str(path.parent)}}
        )
        client.execute()
    return nb


def texts(cell) -> list[str]:
    """A code cell's text: its stdout (chunks joined) and its rich outputs' text in order, with
    addresses masked. stderr (warnings, progress) is not compared."""
    stdout, out = "", []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream" and o["name"] == "stdout":
            stdout += o["text"] if isinstance(o["text"], str) else "".join(o["text"])
        elif o["output_type"] in ("execute_result", "display_data"):
            if "text/plain" in o["data"] and "image/png" not in o["data"]:
                t = o["data"]["text/plain"]
                out.append(t if isinstance(t, str) else "".join(t))
        elif o["output_type"] == "error":
            out.append(f"error: {o['ename']}: {o['evalue']}")
    return [_ADDRESS.sub("0x…", t) for t in ([stdout] if stdout else []) + out]


def pictures(cell) -> int:
    return sum("image/png" in o.get("data", {}) for o in cell.get("outputs", []))


def test_notebooks_exist_and_stay_small():
    names = [p.name for p in NOTEBOOKS]
    assert names == [
        "01_layouts.ipynb",
        "02_mxfp8_planes.ipynb",
        "03_fused_allgather_rmsnorm_quantize.ipynb",
        "04_fsdp_training.ipynb",
    ]
    total = sum(p.stat().st_size for p in NOTEBOOKS)
    assert total < MAX_TOTAL_BYTES, f"notebooks hold {total} bytes; keep them under {MAX_TOTAL_BYTES}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_saved_outputs_are_current(path):
    import nbformat

    saved = nbformat.read(path, as_version=4)
    code = [c for c in saved.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code), (
        f"{path.name} is saved unexecuted: run python tests/test_notebooks.py {path.name}"
    )
    assert sum(pictures(c) for c in code) >= 1, f"{path.name} draws nothing"
    fresh = [c for c in execute(path).cells if c.cell_type == "code"]
    assert len(fresh) == len(code)
    for n, (old, new) in enumerate(zip(code, fresh)):
        where = f"{path.name}, code cell {n + 1}"
        assert not any(o["output_type"] == "error" for o in new.get("outputs", [])), f"{where} raised"
        assert pictures(new) == pictures(old), f"{where}: {pictures(new)} pictures now, {pictures(old)} saved"
        if "measured" in old.metadata.get("tags", []):
            assert bool(texts(new)) == bool(texts(old)), where
        else:
            assert texts(new) == texts(old), f"{where}: saved outputs are stale; rerun python tests/test_notebooks.py"


def _write(paths) -> None:
    import nbformat

    for path in paths:
        nb = execute(path)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.metadata.pop("execution", None)
        nbformat.write(nb, path)
        print(f"{path.name}: {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    wanted = sys.argv[1:]
    _write([p for p in NOTEBOOKS if not wanted or p.name in wanted])
