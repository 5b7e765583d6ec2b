"""``qkv.hf.compare``: how far each head's attention moved between two checkpoints of one architecture.

    table = qkv.hf.compare(base, tuned, inputs)             # inputs: dict of tensors, as for model(**inputs)
    print(table)                                           # heads ranked by the Jensen–Shannon divergence
    table.rows[0]                                          # HeadShift(layer=…, head=…, js_mean=…, js_max=…)

Both models run the same inputs on qkv (:func:`qkv.hf.record`); for every chosen (layer, head) and every real
query row (``attention_mask`` 1; all rows without one) the two rows of attention weights p (model ``a``) and q
(model ``b``) over the keys give

    JS(p, q) = ½ KL(p ‖ m) + ½ KL(q ‖ m),   m = (p + q) / 2,   KL(p ‖ m) = Σ_j p_j log₂(p_j / m_j)

in **bits** (log base 2), so 0 ≤ JS ≤ 1: 0 for identical rows, 1 for rows with no key in common. A term with
p_j = 0 is 0. ``js_mean`` is the mean over the real query rows (every batch row), ``js_max`` the largest; the
table is ranked by ``js_mean`` (then ``js_max``), the heads whose rows moved most first.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

#: The config fields two checkpoints of one architecture share (those a model has).
SHAPE_FIELDS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
                "head_dim", "vocab_size", "sliding_window")


@dataclass(frozen=True)
class HeadShift:
    """One row of the table: layer and head (0-based; the layer is the attention module's name where an
    encoder–decoder repeats the indices, as in :func:`qkv.hf.record`), the mean and the largest JS divergence
    (bits) of its query rows between the two models."""
    layer: int | str
    head: int
    js_mean: float
    js_max: float


@dataclass(frozen=True)
class Comparison:
    """:func:`compare`'s result.

    Attributes:
        rows: the heads, ranked (largest ``js_mean`` first): a tuple of :class:`HeadShift`.
        weights_a, weights_b: ``{layer: (B, heads, L, S) float32}`` the attention weights each model computed
            (qkv's, as :func:`qkv.hf.record` keeps them) — what the page draws side by side.
        heads_of: ``{layer: (heads,) int}`` the heads those weights hold.
        query_mask: (B, L) bool, True at the real query rows the divergences are taken over.
        unit: "bits".
    """
    rows: tuple
    weights_a: dict
    weights_b: dict
    heads_of: dict
    query_mask: np.ndarray
    unit: str = "bits"

    def __str__(self) -> str:
        lines = [f"{'layer':>5}  {'head':>4}  {'JS mean':>9}  {'JS max':>9}   (Jensen–Shannon divergence, "
                 f"{self.unit}; most moved first)"]
        lines += [f"{r.layer:>5}  {r.head:>4}  {r.js_mean:>9.6f}  {r.js_max:>9.6f}" for r in self.rows]
        return "\n".join(lines)


def js_divergence(p, q) -> np.ndarray:
    """The Jensen–Shannon divergence in bits between the distributions on the last axis of ``p`` and ``q``
    (same shape, each row summing to 1): shape ``p.shape[:-1]``, in [0, 1]."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    m = 0.5 * (p + q)

    def kl(x):                                             # Σ x log₂(x / m), 0·log 0 = 0 (and x > 0 ⇒ m > 0)
        safe = np.where(x > 0, x, 1.0) / np.where(x > 0, m, 1.0)
        return np.sum(np.where(x > 0, x * np.log2(safe), 0.0), axis=-1)

    return np.clip(0.5 * kl(p) + 0.5 * kl(q), 0.0, 1.0)


def _unwrap(model, name: str):
    """A transformers model from ``model`` (itself, or a :class:`qkv.hf.Model`'s ``.model``)."""
    inner = getattr(model, "model", None) if hasattr(model, "hf_tokenizer") else model
    if not hasattr(inner, "set_attn_implementation"):
        raise TypeError(f"{name}: expected a transformers PreTrainedModel or a qkv.hf.Model, got "
                        f"{type(model).__name__}")
    return inner


def _shape(model) -> dict:
    c = model.config
    text = getattr(c, "get_text_config", None)
    c = text() if callable(text) else c
    return {k: getattr(c, k) for k in SHAPE_FIELDS if getattr(c, k, None) is not None}


def check_same_architecture(a, b) -> None:
    """ValueError naming ``b`` when its config's shape (:data:`SHAPE_FIELDS`) is not ``a``'s."""
    sa, sb = _shape(a), _shape(b)
    differ = [k for k in SHAPE_FIELDS if sa.get(k) != sb.get(k)]
    if differ:
        want = ", ".join(f"{k}={sa.get(k)}" for k in differ)
        got = ", ".join(f"{k}={sb.get(k)}" for k in differ)
        raise ValueError(f"b: expected a checkpoint of a's architecture ({want}), got {got}")


def _inputs(a_wrapper, inputs):
    """``inputs`` as a dict of tensors: a str is tokenized by the :class:`qkv.hf.Model`'s tokenizer."""
    import torch

    if isinstance(inputs, str):
        tok = getattr(a_wrapper, "hf_tokenizer", None)
        if tok is None:
            raise TypeError("inputs: a str needs a to be a qkv.hf.Model (its tokenizer); give a dict of tensors "
                            "for a transformers model")
        if not inputs.strip():
            raise ValueError(f"inputs: expected a non-empty text, got {inputs!r}")
        ids, mask = a_wrapper._ids([inputs])                    # (1, L) each, cut to the context (a warning)
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask.astype(np.int64))}
    if not isinstance(inputs, Mapping) or not all(isinstance(v, torch.Tensor) for v in inputs.values()):
        raise TypeError(f"inputs: expected a dict of tensors (as for model(**inputs)) or a str, got "
                        f"{type(inputs).__name__}")
    return dict(inputs)                                          # a tokenizer's BatchEncoding is a Mapping


def _weights(model, inputs, layers, heads):
    import torch

    from qkv.integrations.hf._record import record

    with record(model, layers=layers, heads=heads) as rec, torch.no_grad():
        model(**inputs)
    return {k: rec.weights[k] for k in rec.layers}, {k: np.asarray(rec.heads_of[k]) for k in rec.layers}


def compare(a, b, inputs, layers=None, heads=None) -> Comparison:
    """Rank the heads of two checkpoints of one architecture by how much their attention rows moved on
    ``inputs`` (the Jensen–Shannon divergence in bits: see the module).

    Args:
        a, b: transformers models (or :class:`qkv.hf.Model`) of the same architecture (config shape).
        inputs: a dict of tensors as for ``model(**inputs)`` — ``input_ids`` (B, L) and, with padding,
            ``attention_mask`` (B, L), 1 at real tokens (its 0 rows are left out) — or a str when ``a`` is a
            :class:`qkv.hf.Model` (tokenized by its tokenizer).
        layers: None (all) or the layer indices to compare; heads: None (all) or the heads.

    Returns:
        a :class:`Comparison`: ``rows`` ranked, ``weights_a``/``weights_b`` ``{layer: (B, heads, L, S)}``.

    Raises:
        ValueError naming ``b`` for another architecture; TypeError naming ``a``, ``b`` or ``inputs``;
        the errors of :func:`qkv.hf.record` for ``layers`` and ``heads``.
    """
    ma, mb = _unwrap(a, "a"), _unwrap(b, "b")
    check_same_architecture(ma, mb)
    x = _inputs(a, inputs)
    wa, heads_of = _weights(ma, x, layers, heads)
    wb, _ = _weights(mb, x, layers, heads)
    ids = x.get("input_ids")
    mask = x.get("attention_mask")
    first = next(iter(wa.values()))
    B, L = first.shape[0], first.shape[2]
    real = np.ones((B, L), bool) if mask is None else np.asarray(mask.cpu().numpy(), bool)[:, -L:]
    if ids is not None and real.shape != (B, L):
        raise ValueError(f"inputs: expected an attention_mask of shape {(B, L)}, got {real.shape}")
    if not real.any():
        raise ValueError("inputs: expected at least one real token (attention_mask 1), got none")
    rows = []
    for layer, w in wa.items():
        js = js_divergence(w, wb[layer])                                 # (B, h, L)
        picked = js.transpose(1, 0, 2)[:, real]                          # (h, real rows)
        for n, head in enumerate(heads_of[layer]):
            key = layer if isinstance(layer, str) else int(layer)
            rows.append(HeadShift(key, int(head), float(picked[n].mean()), float(picked[n].max())))
    rows.sort(key=lambda r: (-r.js_mean, -r.js_max, r.layer, r.head))
    return Comparison(rows=tuple(rows), weights_a=wa, weights_b=wb, heads_of=heads_of, query_mask=real)
