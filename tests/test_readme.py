"""The README's layout section names every module of the package, and its two commands stay as CI runs them."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layout_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Layout\n") :]
    return section[section.index("```") : section.index("```", section.index("```") + 3)]


def test_readme_layout_lists_every_module():
    block = layout_block()
    missing = []
    for path in sorted((ROOT / "mxfp8_jax").rglob("*.py")):
        rel = path.relative_to(ROOT / "mxfp8_jax")
        if rel.name == "__init__.py" and rel.parent != Path("."):
            continue  # a subpackage's marker, not a module of its own
        short = str(rel.relative_to("_src")) if rel.parts[0] == "_src" else str(rel)
        if not re.search(rf"(^|[\s/,(]){re.escape(short)}\b", block) and f"_src/{short}" not in block:
            missing.append(str(rel))
    assert not missing, f"README.md's layout section does not list {missing}"


def test_readme_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert "pip install . && mxfp8-jax demo" in text
    assert 'pip install -e ".[test]" && python -m pytest -q -n 2' in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && python -m pytest -q -n 2' in ci
    four = "MXFP8_TEST_DEVICES=4 python -m pytest -q -n 2 -m multidevice"
    assert four in text and four in ci
