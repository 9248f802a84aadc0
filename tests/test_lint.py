"""The house style is checked with the tests: ruff (lint and format) over the Python, clang-format
over the C++/CUDA sources (configured in pyproject.toml and .clang-format)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CXX_SUFFIXES = (".cc", ".h", ".cu", ".cuh")


def tool(name):
    """A console script of the test environment (beside this Python), else from PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    assert found, f"{name} is not installed; it comes with the test extra (pip install -e '.[test]')"
    return found


def run(*cmd):
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def test_ruff_lint():
    run(tool("ruff"), "check", ".")


def test_ruff_format():
    run(tool("ruff"), "format", "--check", ".")


def test_clang_format():
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "xla_ffi").rglob("*") if p.suffix in CXX_SUFFIXES)
    assert len(sources) > 20, sources
    assert (ROOT / ".clang-format").exists()
    run(tool("clang-format"), "--dry-run", "-Werror", *sources)
