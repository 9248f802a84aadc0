"""What every style model reads: its sizes (``StyleConfig``), and the words a layer class uses to
say how ``model_styles.build`` initializes a parameter Flax's own layers do not describe.

A layer class that holds raw ``nnx.Param`` arrays names a rule for each beside its code, in a
class attribute ``PARAM_INIT`` (parameter name -> rule):

- ``fan_in(*axes)``: ``N(0, 1/fan_in)``, ``fan_in`` the product of those axes of the parameter's
  shape, counted from the end (so a leading stacked-layer axis does not matter);
- ``IN_FEATURES``: ``N(0, 1/prod(module.in_features))``, for a layer whose contracted axes are
  its ``in_features``;
- ``EMBED``: an embedding table (``N(0, 1)``, or the model's ``EMBED_STD``);
- ``ONES``, ``ZEROS``: constants (norm scales, biases).
"""

from __future__ import annotations

import dataclasses

import numpy as np

ONES, ZEROS, EMBED = ("ones",), ("zeros",), ("embed",)
IN_FEATURES = ("in_features",)


def fan_in(*axes: int) -> tuple:
    """The rule ``N(0, 1/fan_in)`` with ``fan_in`` the product of ``axes`` (negative: from the end)
    of the parameter's shape."""
    return ("kernel", axes)


@dataclasses.dataclass(frozen=True)
class StyleConfig:
    """Sizes of a style model. ``experts``/``capacity`` are read by ``"moe"`` only (``capacity``:
    buffer slots per expert for each sequence of the batch), ``dropout`` by ``"dropout"`` only,
    ``remat`` by all: ``nnx.remat`` around each scan iteration, or around each block call of
    the Python-loop styles."""

    vocab: int = 512
    width: int = 256
    heads: int = 4
    head_dim: int = 64
    mlp: int = 512
    depth: int = 4
    experts: int = 4
    capacity: int = 8
    dropout: float = 0.1
    remat: bool = False

    def __post_init__(self):
        for name in ("vocab", "width", "heads", "head_dim", "mlp", "depth", "experts", "capacity"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"StyleConfig.{name} must be a positive int, got {v!r}")
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, (int, float, np.floating)) or not 0.0 <= d < 1.0:
            raise ValueError(f"StyleConfig.dropout must be a float in [0, 1), got {d!r}")
        if not isinstance(self.remat, (bool, np.bool_)):
            raise ValueError(f"StyleConfig.remat must be a bool, got {self.remat!r}")
