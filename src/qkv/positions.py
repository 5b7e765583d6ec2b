"""Token embeddings and sinusoidal positional encoding: the input of seed 000's path.

    ids → embeddings (vocab lookup) + positions → X, the rows that attention projects into Q, K, V
"""
from __future__ import annotations

import numpy as np

from . import _checks, stages


def sinusoidal_positions(seq_len: int, d_model: int, *, base: float = 10000.0, dtype=np.float32) -> np.ndarray:
    """The positional encoding of "Attention Is All You Need" ``(seq_len, d_model)``.

    ``PE[pos, 2i] = sin(pos / base^(2i/d_model))``, ``PE[pos, 2i+1] = cos(pos / base^(2i/d_model))``.
    An odd ``d_model`` ends with a sine column.
    """
    seq_len = _checks.positive_int(seq_len, "seq_len")
    d_model = _checks.positive_int(d_model, "d_model")
    pos = np.arange(seq_len, dtype=np.float64)[:, None]                     # (T, 1)
    two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]             # (1, ⌈D/2⌉)
    angle = pos / np.power(base, two_i / d_model)                           # (T, ⌈D/2⌉)
    pe = np.zeros((seq_len, d_model), dtype=np.float64)
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle[:, : d_model // 2])
    return pe.astype(dtype)


class TokenEmbedding:
    """A lookup table ``(vocab_size, d_model)``: token id → vector.

    ``weight`` is initialized from N(0, 1) with ``seed`` (as ``torch.nn.Embedding``), or given directly.
    ``embed(ids)`` maps ``(..., T)`` integer ids to ``(..., T, d_model)``; with ``positions=True`` it adds
    :func:`sinusoidal_positions`, which is what seed 000 feeds to W_Q, W_K, W_V.
    """

    def __init__(self, vocab_size: int, d_model: int, *, weight=None, seed=None, dtype=np.float32):
        self.vocab_size = _checks.positive_int(vocab_size, "vocab_size")
        self.d_model = _checks.positive_int(d_model, "d_model")
        if weight is None:
            weight = np.random.default_rng(seed).standard_normal((vocab_size, d_model)).astype(dtype)
        else:
            weight = _checks.float_array(weight, "weight", ndim=2)
            if weight.shape != (vocab_size, d_model):
                raise ValueError(f"weight: expected shape ({vocab_size}, {d_model}), got {weight.shape}")
        self.weight = weight

    def embed(self, ids, *, positions: bool = True) -> np.ndarray:
        ids_arr = np.asarray(ids)
        if ids_arr.size == 0:
            raise ValueError(f"ids: expected a non-empty sequence of token ids, got shape {ids_arr.shape}")
        if ids_arr.dtype == np.bool_ or not np.issubdtype(ids_arr.dtype, np.integer):
            raise TypeError(f"ids: expected integer token ids, got dtype {ids_arr.dtype}")
        if ids_arr.ndim == 0 or ids_arr.shape[-1] == 0:
            raise ValueError(f"ids: expected a non-empty sequence of token ids, got shape {ids_arr.shape}")
        if ids_arr.min() < 0 or ids_arr.max() >= self.vocab_size:
            bad = ids_arr[(ids_arr < 0) | (ids_arr >= self.vocab_size)].ravel()[0]
            raise ValueError(f"ids: expected ids in [0, {self.vocab_size}), got {int(bad)}")
        x = self.weight[ids_arr]                                                # (..., T, D)
        stages.observe_input("embeddings", x, "embeddings = E[ids]")
        if positions:
            pe = sinusoidal_positions(ids_arr.shape[-1], self.d_model, dtype=self.weight.dtype)
            x = x + pe                                                          # (..., T, D) + (T, D)
            stages.observe_input("X", x, "X = embeddings + PE")
        return x

    __call__ = embed
