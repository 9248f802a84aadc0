"""How the style models create and run their blocks: created at once and stacked (``nnx.vmap``)
then run by ``nnx.scan``, or held in an ``nnx.List`` and called in a Python loop; the causal
mask the hand-written attentions share; the initializers their layers are created with (the
values ``model_styles.build`` sets replace them; ``abstract`` keeps only their shapes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mxfp8_jax.bench.styles.config import StyleConfig

normal_init = nnx.initializers.normal(0.02)
lecun_init = nnx.initializers.lecun_normal()


def stacked(block: type, cfg: StyleConfig, rngs: nnx.Rngs) -> nnx.Module:
    """``cfg.depth`` blocks created at once, stacked (``nnx.split_rngs`` + ``nnx.vmap``): one
    module whose parameters carry a leading layer axis."""

    @nnx.split_rngs(splits=cfg.depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs: nnx.Rngs):
        return block(cfg, rngs=rngs)

    return create(rngs)


def scanned(blocks: nnx.Module, x, remat: bool, *args):
    """``x`` through the stacked ``blocks`` one layer per ``nnx.scan`` iteration (each under
    ``nnx.remat`` when ``remat``); ``args`` are passed to every block unchanged."""

    def step(x, block):
        return block(x, *args)

    if remat:
        step = nnx.remat(step)
    return nnx.scan(step, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, blocks)


def call_block(layer, *args):
    """``layer(*args)``: what a Python loop over blocks calls (under ``nnx.remat`` when asked)."""
    return layer(*args)


def causal(t: int) -> jax.Array:
    return jnp.tril(jnp.ones((t, t), dtype=bool))
