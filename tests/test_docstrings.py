"""The public API reads in an editor: every public function, class method and method of
``mxfp8_jax``, ``mxfp8_jax.flax`` and ``mxfp8_jax.models`` that takes arguments documents them
in an ``Args:`` section, and one that returns a value says what in a ``Returns:`` section."""

import inspect

import mxfp8_jax
import mxfp8_jax.flax
import mxfp8_jax.models

MODULES = (mxfp8_jax, mxfp8_jax.flax, mxfp8_jax.models)


def public_callables():
    """``(qualified name, function)`` of every public function and method of the public modules."""
    for mod in MODULES:
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isfunction(obj):
                yield f"{mod.__name__}.{name}", obj
            elif inspect.isclass(obj) and obj.__module__.startswith("mxfp8_jax"):
                for attr, value in vars(obj).items():
                    fn = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
                    if not attr.startswith("_") and inspect.isfunction(fn):
                        yield f"{mod.__name__}.{name}.{attr}", fn


def missing_sections(fn) -> list[str]:
    doc = inspect.getdoc(fn) or ""
    sig = inspect.signature(fn)
    out = []
    if any(p not in ("self", "cls") for p in sig.parameters) and "\nArgs:\n" not in f"\n{doc}\n":
        out.append("Args")
    returns = sig.return_annotation
    if returns not in (None, "None", inspect.Signature.empty) and "\nReturns:\n" not in f"\n{doc}\n":
        out.append("Returns")
    return out


def test_public_api_has_args_and_returns_sections():
    gaps = {name: m for name, fn in public_callables() if (m := missing_sections(fn))}
    assert not gaps, "docstrings without sections: " + "; ".join(
        f"{k} ({', '.join(v)})" for k, v in sorted(gaps.items())
    )


def test_the_check_finds_a_missing_section():
    def documented(x: int) -> int:
        """Doubles.

        Args:
          x: a number.

        Returns:
          2x.
        """

    def bare(x: int) -> int:
        """Doubles."""

    assert missing_sections(documented) == [] and missing_sections(bare) == ["Args", "Returns"]
