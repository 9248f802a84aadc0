"""The ``"dropout"`` style: ``nnx.Dropout`` layers (and attention dropout) keeping their own RNG streams,
blocks in a Python loop, as everyday Flax NNX training scripts write them."""

from __future__ import annotations

from flax import nnx

from mxfp8_jax.bench.styles.blocks import call_block
from mxfp8_jax.bench.styles.config import StyleConfig


class DropoutBlock(nnx.Module):
    """Pre-LN block: causal ``nnx.MultiHeadAttention`` with attention dropout, then an
    ``nnx.Linear`` MLP with dropout after the activation; dropout on both residual branches."""

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=cfg.heads,
            in_features=cfg.width,
            qkv_features=cfg.heads * cfg.head_dim,
            dropout_rate=cfg.dropout,
            deterministic=False,
            decode=False,
            rngs=rngs,
        )
        self.attn_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.fc1 = nnx.Linear(cfg.width, cfg.mlp, rngs=rngs)
        self.act_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.fc2 = nnx.Linear(cfg.mlp, cfg.width, rngs=rngs)
        self.resid_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn_dropout(self.attn(self.ln1(x), mask=mask))
        h = self.act_dropout(nnx.gelu(self.fc1(self.ln2(x))))
        return x + self.resid_dropout(self.fc2(h))


class DropoutModel(nnx.Module):
    """The everyday Flax NNX training-script model: ``nnx.Dropout`` layers (and the attention's
    own dropout) each holding a stream forked from the model's ``nnx.Rngs(dropout=...)``, so a
    call draws fresh masks and advances the streams' counters; training mode by default
    (``nnx.view(model, deterministic=True)`` or ``model.eval()`` for evaluation). Blocks in an
    ``nnx.List`` run by a Python loop, ``nnx.Embed`` tokens, untied ``nnx.Linear`` head."""

    STYLE = "dropout"
    DESCRIPTION = (
        "nnx.Dropout (own forked RNG streams) after embed, attention, activation and residual + "
        "MultiHeadAttention dropout; nnx.Linear MLP; nnx.List + Python loop; untied nnx.Linear head; train mode"
    )

    def __init__(self, cfg: StyleConfig, *, rngs: nnx.Rngs):
        self.remat = cfg.remat
        self.embed = nnx.Embed(cfg.vocab, cfg.width, rngs=rngs)
        self.embed_dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
        self.blocks = nnx.List([DropoutBlock(cfg, rngs=rngs) for _ in range(cfg.depth)])
        self.final_norm = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.head = nnx.Linear(cfg.width, cfg.vocab, rngs=rngs)

    def __call__(self, tokens):
        mask = nnx.make_causal_mask(tokens)
        x = self.embed_dropout(self.embed(tokens))
        call = nnx.remat(call_block) if self.remat else call_block
        for block in self.blocks:
            x = call(block, x, mask)
        return self.head(self.final_norm(x))
