"""The planted-bug list of scripts/mutants.py stays meaningful: every edit still applies exactly
once to the package's sources and every test it names exists. (Running the mutants themselves
takes minutes and is done on demand: see docs/design.md §8.)"""

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


@pytest.mark.parametrize("mutant", harness.MUTANTS, ids=lambda m: m.name)
def test_mutant_applies_and_names_real_tests(mutant, tmp_path):
    package = tmp_path / "mxfp8_jax"
    shutil.copytree(ROOT / "mxfp8_jax", package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    before = {p: p.read_text() for p in package.rglob("*.py")}
    harness.apply(mutant, package)
    changed = [p for p in package.rglob("*.py") if p.read_text() != before[p]]
    assert changed, f"{mutant.name} changes nothing"
    for node in mutant.tests:
        path, _, name = node.partition("::")
        assert (ROOT / path).is_file(), node
        if name:
            assert f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), node


def test_a_stale_pattern_fails_loudly(tmp_path):
    stale = harness.Mutant("stale", "no longer matches", (("_src/numerics/format.py", "no such line", "x"),), ())
    shutil.copytree(ROOT / "mxfp8_jax", tmp_path / "mxfp8_jax", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    with pytest.raises(harness.PatternError, match="'stale'.*occurs 0 times in mxfp8_jax/_src/numerics/format.py"):
        harness.apply(stale, tmp_path / "mxfp8_jax")
