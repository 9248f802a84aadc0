"""The ``"moe"`` style: a Switch-Transformer-style top-1 mixture of experts with stacked expert weights
and dense one-hot dispatch/combine einsums, blocks created stacked by ``nnx.vmap`` and run by ``nnx.scan``."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from mxfp8_jax.bench.styles.blocks import normal_init, scanned, stacked
from mxfp8_jax.bench.styles.config import StyleConfig, fan_in


class SwitchMLP(nnx.Module):
    """Top-1 mixture of experts. Router ``nnx.Linear(D, E)``; expert weights ``wi [E, D, F]``
    and ``wo [E, F, D]``. The batch's tokens are flattened to ``t``; each expert has ``C =
    capacity * batch`` buffer slots filled in token order (later tokens over capacity are
    dropped: they pass by the residual only). Dense one-hot ``dispatch [t, E, C]`` gathers the
    expert inputs, ``combine`` (dispatch times the router probability) scatters them back."""

    PARAM_INIT: ClassVar[dict[str, tuple]] = {"wi": fan_in(-2), "wo": fan_in(-2)}

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.experts, self.capacity = cfg.experts, cfg.capacity
        self.router = nnx.Linear(cfg.width, cfg.experts, use_bias=False, rngs=rngs)
        self.wi = nnx.Param(normal_init(rngs.params(), (cfg.experts, cfg.width, cfg.mlp)))
        self.wo = nnx.Param(normal_init(rngs.params(), (cfg.experts, cfg.mlp, cfg.width)))

    def __call__(self, x):
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        probs = jax.nn.softmax(self.router(tokens), axis=-1)  # [t, E]
        expert = jnp.argmax(probs, axis=-1)
        gate = jnp.max(probs, axis=-1)
        expert_mask = jax.nn.one_hot(expert, self.experts, dtype=jnp.int32)  # [t, E]
        position = jnp.cumsum(expert_mask, axis=0) * expert_mask - 1  # slot in the expert's buffer, -1 if not routed
        capacity = self.capacity * b
        dispatch = jax.nn.one_hot(position, capacity, dtype=x.dtype)  # [t, E, C]; -1 and >= C give zeros
        combine = dispatch * gate[:, None, None]
        xe = jnp.einsum("tec,td->ecd", dispatch, tokens)
        h = jnp.einsum("ecd,edf->ecf", xe, self.wi[...])
        ye = jnp.einsum("ecf,efd->ecd", nnx.gelu(h), self.wo[...])
        y = jnp.einsum("tec,ecd->td", combine, ye)
        return y.reshape(b, t, d)


class MoEAttention(nnx.Module):
    """Attention from four ``nnx.Linear`` (no bias) and ``jax.nn.dot_product_attention``."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        inner = cfg.heads * cfg.head_dim
        self.q_proj = nnx.Linear(cfg.width, inner, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(cfg.width, inner, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(cfg.width, inner, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(inner, cfg.width, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        split = lambda y: y.reshape(b, t, self.heads, self.head_dim)
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.reshape(b, t, self.heads * self.head_dim))


class MoEBlock(nnx.Module):
    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.attn = MoEAttention(cfg, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.moe = SwitchMLP(cfg, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.mlp_norm(x))


class MoEModel(nnx.Module):
    """A Switch-Transformer-style decoder: every block's MLP a top-1 mixture of experts with
    stacked expert weights and dense one-hot dispatch/combine einsums (the expert axis a batch
    axis of the expert contractions). Blocks created stacked by ``nnx.vmap`` and run by
    ``nnx.scan`` (``nnx.remat`` when ``cfg.remat``), so expert weights are ``[L, E, D, F]``;
    ``nnx.Embed`` tokens, untied ``nnx.Linear`` head. No load-balancing loss."""

    STYLE = "moe"
    DESCRIPTION = (
        "Switch-like top-1 MoE: router nnx.Linear, experts wi [E,D,F] / wo [E,F,D] via dense one-hot "
        "dispatch/combine einsums; nnx.Linear attention; vmap-stacked, nnx.scan (remat optional); untied head"
    )

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.remat = cfg.remat
        self.embed = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        self.blocks = stacked(MoEBlock, cfg, rngs)
        self.norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        self.lm_head = nnx.Linear(cfg.width, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = scanned(self.blocks, self.embed(tokens), self.remat)
        return self.lm_head(self.norm(x))
