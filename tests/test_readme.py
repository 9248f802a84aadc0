"""The docs' file tree (docs/layout.md) lists every module of the package where it is, and the
README keeps its two commands as CI runs them, and its links to the docs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layout_block() -> str:
    text = (ROOT / "docs" / "layout.md").read_text()
    start = text.index("```\n") + 4
    return text[start : text.index("\n```", start)]


def listed_files(block: str) -> set[str]:
    """The files the tree names, as paths: a line's leading names ending in ``/`` open a folder
    at their indent, those ending in ``.py`` are files in the enclosing folder."""
    folders: list[tuple[int, str]] = []  # (indent, path) of the open folders
    files = set()
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        while folders and folders[-1][0] >= indent:
            folders.pop()
        here = folders[-1][1] if folders else ""
        entries = [n.strip() for n in names.split(",")]
        if len(entries) == 1 and entries[0].endswith("/"):
            folders.append((indent, here + entries[0]))
            continue
        files.update(here + e for e in entries if e.endswith(".py"))
    return files


def test_the_layout_page_lists_every_module_where_it_is():
    listed = {f for f in listed_files(layout_block()) if f.startswith("mxfp8_jax/")}
    have = set()
    for path in sorted((ROOT / "mxfp8_jax").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.name == "__init__.py" and rel.parent != Path("mxfp8_jax"):
            continue  # a sub-package's docstring, not a module of its own
        have.add(str(rel))
    assert have - listed == set(), f"docs/layout.md does not list {sorted(have - listed)}"
    assert listed - have == set(), f"docs/layout.md lists files that do not exist: {sorted(listed - have)}"


def test_the_tree_reader_places_files_under_their_folders():
    block = "a/\n  x.py, y.py   two files\n  b/       a folder\n    z.py   deeper\n  w.py     back up\nc/   other\n"
    assert listed_files(block) == {"a/x.py", "a/y.py", "a/b/z.py", "a/w.py"}


TEST_COMMANDS = (
    'pip install -e ".[test]" -c constraints/newest.txt && python -m pytest -q -n 2',
    "MXFP8_TEST_DEVICES=4 python -m pytest -q -n 2 -m device_count",
    'pip install -e ".[test,gpu-compile]" -c constraints/newest.txt && python -m pytest -q -n 2 -m gpu_compile',
    'pip install -e ".[test]" -c constraints/oldest.txt && python -m pytest -q -n 2 -m compat',
)


def test_readme_keeps_the_two_commands_and_ci_runs_its_test_commands():
    text = (ROOT / "README.md").read_text()
    assert "pip install . && mxfp8-jax demo" in text
    ci = (ROOT / ".ci" / "run").read_text()
    shown = re.findall(r"```bash\n(.*?)\n```", text, re.S)
    for command in TEST_COMMANDS:
        assert command in shown, f"the README does not show {command!r} as a command block"
        assert command in ci.splitlines(), f".ci/run does not run the README's {command!r} verbatim"
    for name in ("newest", "oldest"):
        assert (ROOT / "constraints" / f"{name}.txt").is_file()


def test_the_docs_links_lead_to_files():
    """Every relative link of the README and the docs pages names a file of the repository."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
