"""The planted-bug list of scripts/mutants.py stays meaningful: every edit still applies exactly
once to the sources (the package's Python, the GPU kernels' sources and their HIP-CPU shims) and
every test it names exists; each GPU mutant is caught by a hipcpu test. (Running the mutants
themselves takes minutes and is done on demand: see docs/design.md §8.)"""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _harness():
    spec = importlib.util.spec_from_file_location("mutants_harness", ROOT / "scripts" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


harness = _harness()


def _copy_sources(dest: Path) -> None:
    for folder in ("mxfp8_jax", "xla_ffi"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so"))


@pytest.mark.parametrize("mutant", harness.MUTANTS, ids=lambda m: m.name)
def test_mutant_applies_and_names_real_tests(mutant, tmp_path):
    _copy_sources(tmp_path)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    before = {p: p.read_bytes() for p in files}
    harness.apply(mutant, tmp_path)
    changed = [p for p in files if p.read_bytes() != before[p]]
    assert changed, f"{mutant.name} changes nothing"
    for node in mutant.tests:
        path, _, name = node.partition("::")
        assert (ROOT / path).is_file(), node
        if name:
            assert f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), node
    if mutant.gpu:  # nothing else runs the GPU sources
        assert all(t.startswith("tests/test_hipcpu.py") for t in mutant.tests), mutant.tests


def test_there_are_gpu_mutants_of_each_kind():
    gpu = [m for m in harness.MUTANTS if m.gpu]
    kinds = ("an index", "a shuffle", "a tail condition", "a barrier")
    for kind in kinds:
        assert any(kind in m.what for m in gpu), kind


def test_a_stale_pattern_fails_loudly(tmp_path):
    stale = harness.Mutant(
        "stale", "no longer matches", (("mxfp8_jax/_src/numerics/format.py", "no such line", "x"),), ()
    )
    _copy_sources(tmp_path)
    with pytest.raises(harness.PatternError, match="'stale'.*occurs 0 times in mxfp8_jax/_src/numerics/format.py"):
        harness.apply(stale, tmp_path)
