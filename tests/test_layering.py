"""The layering table of docs/design.md §1 is the package's import graph: every module is on
exactly one line, and no module imports one of a later line (a higher layer), not even inside a
function. A new module, or an import that points upward, fails here until the table says so.
The kernels' C++ headers likewise follow the list of xla_ffi/README.md's "Sources"."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mxfp8_jax"


def layers() -> list[list[str]]:
    """The names on each line of the table, bottom layer first."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text[text.index("## 1. The house") :]
    block = section[section.index("```\n") + 4 : section.index("\n```", section.index("```\n") + 4)]
    out = []
    for line in block.splitlines():
        names, _, _ = line.partition("  ")  # the names, then two spaces or more, then what they are
        out.append([n.strip() for n in names.split(",")])
    return out


def key(module: str) -> str:
    """The table's name for a module path relative to the package (``_src.buffers.dbuffer``,
    ``bench.fsdp``)."""
    parts = module.split(".")
    if parts[0] == "_src":
        return parts[-1]
    if parts[0] in ("__init__", ""):
        return "mxfp8_jax"
    return parts[0]  # demo, cli, flax, models, viz, bench (the benchmarks are one layer)


def modules() -> dict[str, Path]:
    """Every module of the package by dotted path, but the sub-packages' ``__init__`` files
    (docstrings only)."""
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = p.relative_to(PACKAGE).with_suffix("")
        if rel.name != "__init__" or rel.parent == Path("."):
            out[".".join(rel.parts)] = p
    return out


def imported(path: Path, known: set[str]) -> set[str]:
    """The package modules ``path`` imports, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "mxfp8_jax" or alias.name.startswith("mxfp8_jax."):
                    out.add(alias.name.removeprefix("mxfp8_jax").lstrip(".") or "__init__")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module != "mxfp8_jax" and not node.module.startswith("mxfp8_jax."):
                continue
            base = node.module.removeprefix("mxfp8_jax").lstrip(".")
            for alias in node.names:  # a submodule by name, or a name the module defines
                sub = f"{base}.{alias.name}" if base else alias.name
                out.add(sub if sub in known else (base or "__init__"))
    return out


def test_every_module_is_on_one_line_of_the_table():
    names = [n for line in layers() for n in line]
    assert len(names) == len(set(names)), f"listed twice: {sorted({n for n in names if names.count(n) > 1})}"
    have = {key(m) for m in modules()}
    assert have - set(names) == set(), f"docs/design.md §1 does not place {sorted(have - set(names))}"
    assert set(names) - have == set(), f"docs/design.md §1 names modules that do not exist: {sorted(set(names) - have)}"


def test_no_module_imports_a_higher_layer():
    level = {n: i for i, line in enumerate(layers()) for n in line}
    mods = modules()
    upward = []
    for name, path in mods.items():
        for dep in imported(path, set(mods)):
            if level[key(dep)] > level[key(name)]:
                upward.append(f"{name} -> {dep}")
    assert not upward, "imports pointing up the layers of docs/design.md §1: " + ", ".join(sorted(upward))


def test_the_check_sees_imports_inside_functions(tmp_path):
    """The oracle itself: an import in a function body counts, as one at the top does."""
    f = tmp_path / "m.py"
    f.write_text("def save():\n    from mxfp8_jax._src.buffers import checkpoint\n    from mxfp8_jax import demo\n")
    assert imported(f, {"_src.buffers.checkpoint", "demo"}) == {"_src.buffers.checkpoint", "demo"}


def test_the_sub_packages_are_floors_of_the_table():
    """``mxfp8_jax/_src``'s sub-packages follow the table: each holds consecutive lines, so the
    file tree shows the layers in the order the imports allow."""
    where = {}
    for name in modules():
        parts = name.split(".")
        if parts[0] == "_src":
            where[parts[-1]] = parts[1]
    order = [where[n] for line in layers() for n in line if n in where]
    runs = [p for i, p in enumerate(order) if i == 0 or order[i - 1] != p]
    assert len(runs) == len(set(runs)), f"sub-packages interleaved along docs/design.md §1: {runs}"


MAX_LINES = 700


def test_no_module_over_700_lines():
    """Every module of ``mxfp8_jax/_src`` holds one concern that a reader can take in whole: none
    runs past ``MAX_LINES`` lines (split one by responsibility before it does)."""
    long = {}
    for p in sorted((PACKAGE / "_src").rglob("*.py")):
        n = len(p.read_text().splitlines())
        if n > MAX_LINES:
            long[str(p.relative_to(ROOT))] = n
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def header_order() -> list[str]:
    """The kernels' headers in the order xla_ffi/README.md's "Sources" names them (bottom first)."""
    text = (ROOT / "xla_ffi" / "README.md").read_text()
    section = text[text.index("## Sources\n") :]
    section = section[: section.index("\n## ")]
    order = []
    for name in re.findall(r"`([\w/]+\.(?:h|cuh))`", section):
        if name not in order:
            order.append(name)
    return order


def test_kernel_headers_include_only_headers_named_before_them():
    """Every header of the kernels is named in the list, and includes only those before it."""
    files = {}
    for pattern in ("include/mxfp8/*.h", "cpu/*.h", "gpu/*.h", "gpu/*.cuh"):
        for p in sorted((ROOT / "xla_ffi").glob(pattern)):
            assert p.name not in files, f"two headers named {p.name}: the list names them by file name"
            files[p.name] = p
    order = header_order()
    assert sorted(order) == sorted(files), "xla_ffi/README.md's Sources list and the headers differ"
    rank = {name: i for i, name in enumerate(order)}
    for name, path in files.items():
        for inc in re.findall(r'#include "([^"]+)"', path.read_text()):
            base = inc.rsplit("/", 1)[-1]
            if inc.startswith("xla/"):
                continue  # jaxlib's FFI headers
            assert rank[base] < rank[name], f"{path.relative_to(ROOT)} includes {inc}, named after it"
