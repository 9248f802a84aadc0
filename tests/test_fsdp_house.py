"""How the FSDP package is built, checked on its source: the plan is a value that nothing
patches, and the facade stays a facade."""

import ast
import inspect
import textwrap
from pathlib import Path

from mxfp8_jax._src.fsdp import flax_fsdp

FSDP_PACKAGE = Path(flax_fsdp.__file__).parent
# ``flax.tensor_parallel(layer, role)`` marks a layer of the user's model: not a class of ours
USERS_OBJECTS = {"flax_layers.py": ["layer.tensor_parallel"]}


def outside_assignments(source: str) -> list[str]:
    """Every assignment to an attribute of something other than ``self`` or ``cls`` (``a.b = ...``,
    ``self.x.y = ...``, ``setattr(...)``), as ``line: text``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store):
                    if not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")):
                        found.append(f"{t.lineno}: {ast.unparse(t)}")
    return found


def test_no_fsdp_object_has_attributes_set_from_outside():
    found = {}
    for p in sorted(FSDP_PACKAGE.glob("*.py")):
        allowed = USERS_OBJECTS.get(p.name, [])
        hits = [h for h in outside_assignments(p.read_text()) if h.split(": ", 1)[1] not in allowed]
        if hits:
            found[p.name] = hits
    assert not found, f"attributes set on another object: {found}"


def test_the_check_finds_an_attribute_set_from_outside():
    source = "def f(steps, x):\n    steps.partition = x\n\nclass A:\n    def g(self):\n"
    source += "        self.a = 1\n        self.b.c = 2\n"
    assert outside_assignments(source) == ["2: steps.partition", "7: self.b.c"]


def test_fsdp_init_is_a_facade():
    """``FSDP.__init__`` makes the plan and the objects that take it, and nothing else: at most
    40 lines without its docstring."""
    fn = ast.parse(textwrap.dedent(inspect.getsource(flax_fsdp.FSDP.__init__))).body[0]
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    lines = body[-1].end_lineno - fn.lineno + 1 - sum(b.end_lineno - b.lineno + 1 for b in fn.body if b not in body)
    assert lines <= 40, f"FSDP.__init__ is {lines} lines"
