"""Example models written in plain Flax NNX, for training with ``mxfp8_jax.flax.FSDP``.

    from mxfp8_jax import models

    cfg = models.TransformerConfig(vocab=128, hidden=128, layers=4)
    model = models.init_transformer(cfg, seed=0)          # scanned, rematerialised blocks
    task = models.SequenceTask(cfg.vocab, seq_len=64)     # x[t+1] = perm[x[t-1]]
    loss = models.next_token_loss(model, next(task.batches(1, 8)))
    text = models.TextTask(seq_len=128)                   # byte-level LM on stdlib sources

See ``mxfp8_jax._src.models.transformer``.
"""

from mxfp8_jax._src.models.text_task import TextTask
from mxfp8_jax._src.models.transformer import (
    MLP,
    Attention,
    Block,
    SequenceTask,
    TransformerConfig,
    TransformerLM,
    init_transformer,
    next_token_loss,
    next_token_pairs,
    rope,
)

__all__ = [
    "MLP",
    "Attention",
    "Block",
    "SequenceTask",
    "TextTask",
    "TransformerConfig",
    "TransformerLM",
    "init_transformer",
    "next_token_loss",
    "next_token_pairs",
    "rope",
]
