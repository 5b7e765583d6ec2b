"""The validated worked example (:class:`Worked`) and the steps it may claim numbers for."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qkv.core.stages import PIPELINE_ORDER, Names


#: The steps a worked example may claim numbers for, in pipeline order (:data:`qkv.stages.PIPELINE_ORDER`
#: without ``modified`` — no custom score mod in a file — and ``masked``, whose −∞ is not a number to claim).
CLAIM_NAMES = tuple(n for n in PIPELINE_ORDER if n not in (Names.MODIFIED, Names.MASKED))
#: The claimable steps whose rows are keys (labelled by ``kv_tokens``), not queries.
KEY_SIDE = (Names.K, Names.V, Names.K_ROT)


@dataclass
class Worked:
    """A worked example, validated: arrays are float64 NumPy arrays, claims keep the numbers as written.

    ``claims`` maps a step name (one of :data:`CLAIM_NAMES`) to ``{row index: [number or None, ...]}``;
    each number is a :class:`Number` (a float that keeps its text). ``tokens`` always has one label per
    query row (``#0``, ``#1``, ... when the file gives none; ``tokens_given`` says which).
    ``kv_tokens`` labels the key rows in cross-attention (None in self-attention).
    """

    title: str | None = None
    tokens: list[str] | None = None
    kv_tokens: list[str] | None = None
    X: np.ndarray | None = None
    X_kv: np.ndarray | None = None
    W_Q: np.ndarray | None = None
    W_K: np.ndarray | None = None
    W_V: np.ndarray | None = None
    Q: np.ndarray | None = None
    K: np.ndarray | None = None
    V: np.ndarray | None = None
    scores: np.ndarray | None = None
    d_k: float | None = None
    mask: Any = None                       # "causal", a bool ndarray (L, S) (True = may attend), or None
    heads: int = 1
    W_O: np.ndarray | None = None
    claims: dict = field(default_factory=dict)
    tolerance: float | None = None
    description: str | None = None
    name: str | None = None                # the built-in name, or the file name
    tokens_given: bool = False
    kv_tokens_given: bool = False
    # the variants (None: not used)
    rope: dict | None = None               # {"theta": float, "style": "neox" | "interleaved"}
    positions: np.ndarray | None = None    # (L,) the queries' RoPE positions (default 0 … L−1)
    kv_positions: np.ndarray | None = None  # (S,) the keys' (default: the queries' in self-attention, else 0 … S−1)
    alibi: Any = None                      # True (slopes from the head count) or an (H,) array of slopes
    softcap: float | None = None           # c in c·tanh(s / c)
    window: int | None = None              # causal sliding window of this many keys
    prefix: int | None = None              # prefix LM: the first N keys visible to every query, the rest causal
    documents: np.ndarray | None = None    # (S,) the document id of each position
    sinks: int | None = None               # the first N keys visible to every query (or-ed with the other mask)
    sink_logits: np.ndarray | None = None  # (H,) learned sink logits in the softmax denominator

    @property
    def has_mask_mods(self) -> bool:
        """True when a mask key beyond ``mask`` (window, prefix, documents, sinks) is set."""
        return any(x is not None for x in (self.window, self.prefix, self.documents, self.sinks))

    def mask_matrix(self, mask=None):
        """The mask the runner applies, as data: ``"causal"``, a bool (L, S) matrix (True = may attend), or
        None. With window/prefix/documents/sinks it is their mask mod evaluated on (L, S); ``mask`` overrides
        the file's ``mask:`` key as in :func:`run`."""
        m = _resolve_mask(self, mask)
        if not self.has_mask_mods:
            return m
        from qkv.core import mods, pipeline
        L, S = self.n_queries, self.n_keys
        b, h, q_idx, kv_idx = pipeline.indices((), L, S)
        dense = mods.call_mask_mod(_mask_mod(self, m, L, S), b, h, q_idx, kv_idx)
        return np.array(np.broadcast_to(dense, (L, S)))

    @property
    def has_variants(self) -> bool:
        return self.has_mask_mods or any(x is not None for x in (self.rope, self.alibi, self.softcap,
                                                                 self.sink_logits))

    # -------- derived facts
    @property
    def start(self) -> str:
        """The starting point: ``"X"``, ``"QK"`` or ``"scores"``."""
        if self.X is not None:
            return "X"
        if self.Q is not None:
            return "QK"
        return "scores"

    @property
    def is_cross(self) -> bool:
        if self.start == "X":
            return self.X_kv is not None
        if self.start == "QK":
            return self.K.shape[0] != self.Q.shape[0] or self.kv_tokens_given
        return self.scores.shape[1] != self.scores.shape[0] or self.kv_tokens_given

    @property
    def n_queries(self) -> int:
        return {"X": lambda: self.X.shape[0], "QK": lambda: self.Q.shape[0],
                "scores": lambda: self.scores.shape[0]}[self.start]()

    @property
    def n_keys(self) -> int:
        if self.start == "X":
            return (self.X if self.X_kv is None else self.X_kv).shape[0]
        if self.start == "QK":
            return self.K.shape[0]
        return self.scores.shape[1]

    @property
    def key_labels(self) -> list[str]:
        """Labels of the key/value rows: ``kv_tokens``, or the tokens in self-attention."""
        if self.kv_tokens is not None:
            return list(self.kv_tokens)
        if self.tokens is not None and len(self.tokens) == self.n_keys:
            return list(self.tokens)
        return [f"#{j}" for j in range(self.n_keys)]

    def key_width(self) -> int | None:
        if self.start == "X":
            return self.W_K.shape[1]
        if self.start == "QK":
            return self.K.shape[1]
        return None


# ----------------------------------------------------------------------------------------------- its mask
def _resolve_mask(worked: Worked, mask):
    L, S = worked.n_queries, worked.n_keys
    if mask is None:
        return worked.mask
    if isinstance(mask, str):
        m = mask.strip().lower()
        if m == "none":
            return None
        if m == "causal":
            return "causal"
        raise ValueError(f"mask: expected 'causal', 'none', a boolean array or None, got {mask!r}")
    arr = np.asarray(mask)
    if arr.dtype != np.bool_:
        raise TypeError(f"mask: expected a boolean array (True = may attend), got dtype {arr.dtype}")
    try:
        np.broadcast_shapes(arr.shape, (L, S))
    except ValueError:
        raise ValueError(f"mask: expected a boolean array broadcastable to ({L}, {S}), got shape {arr.shape}") from None
    if arr.ndim > 2 and worked.heads == 1:
        raise ValueError(f"mask: expected a boolean array of shape ({L}, {S}), got shape {arr.shape}")
    return np.broadcast_to(arr, (L, S)).copy() if arr.ndim <= 2 else arr


def _mask_mod(worked: Worked, m, L: int, S: int):
    """The example's mask as a :class:`qkv.mods.MaskMod` when it uses window, prefix, documents or sinks
    (``mask:`` and-ed with them; ``sinks`` or-ed with the result, or with causal when nothing else masks);
    None otherwise."""
    from qkv.core import mods

    parts = []
    if isinstance(m, str) and m == "causal":
        parts.append(mods.causal())
    elif m is not None:
        given = np.asarray(m, dtype=bool)

        def file_mask(b, h, q_idx, kv_idx):
            return given[q_idx, kv_idx]
        parts.append(mods.MaskMod(file_mask, name="matrix"))
    if worked.window is not None:
        parts.append(mods.sliding_window(worked.window))
    if worked.prefix is not None:
        parts.append(mods.prefix_lm(worked.prefix))
    if worked.documents is not None:
        parts.append(mods.document(worked.documents))
    mod = None if not parts else parts[0] if len(parts) == 1 else mods.and_masks(*parts)
    if worked.sinks is not None:
        mod = mods.or_masks(mods.sinks(worked.sinks), mod if mod is not None else mods.causal())
    return mod
