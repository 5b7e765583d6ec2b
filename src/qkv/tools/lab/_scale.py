"""``qkv lab scale``: why ÷ √d_k — seed 002's claim, measured on qkv's own forward and backward.

"When d_k grows, the variance of the dot product grows; scores that are too large push softmax towards
one-hot and the gradients of the non-maximal entries to zero; scaling by √d_k brings the scores back."

For each d_k in 4, 8, … 1024: queries and keys with independent unit-variance entries (``samples`` query
rows, each against ``keys`` keys), values and an upstream gradient likewise, through
:func:`qkv.scaled_dot_product_attention` twice — ``scale=1`` (no scaling) and the default 1/√d_k — recording
the stages in a :class:`qkv.Trace`:

* ``score_var``: the variance of q·k (the trace's ``scores``; theory: d_k), ``score_var_scaled`` of
  q·k/√d_k (the ``scaled`` step; theory: 1);
* ``max_weight`` / ``entropy``: the mean over rows of the largest softmax weight and of the weights' entropy
  (nats; uniform over the keys would be ln keys);
* ``grad_norm``: the median over rows (the typical query) of ‖∂loss/∂s‖, the gradient with respect to the scores s that enter the
  softmax, for the loss ⟨G, output⟩ (G the upstream gradient). It comes from qkv's backward,
  :func:`qkv.flex_attention_backward`, run on query = the scores and key = the identity (so Q·Kᵀ = s with
  scale 1): its gradient for the query is exactly ∂loss/∂s. (The gradient for the real queries follows by the
  chain rule: ∂loss/∂q = scale · ∂loss/∂s · K; ``tests/unit/test_lab.py`` holds the two together.) The mean
  over rows is in ``grad_norm_mean``: it falls far less, because the few rows whose two largest scores
  happen to be close keep a gradient of order 1 — saturation silences the typical row, not every row.
"""
from __future__ import annotations

import math

import numpy as np

import qkv
from qkv.locales import t
from qkv.tools.lab import common as C

D_KS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)


def score_gradient(s: np.ndarray, v: np.ndarray, g: np.ndarray) -> np.ndarray:
    """∂⟨g, softmax(s)·v⟩/∂s from qkv's backward: ``flex_attention_backward`` on query = s, key = I, scale 1.

    s: (..., L, S) scores entering the softmax, v: (..., S, Ev), g: (..., L, Ev) → (..., L, S).
    """
    S = s.shape[-1]
    eye = np.broadcast_to(np.eye(S, dtype=s.dtype), s.shape[:-2] + (S, S))
    dq, _, _ = qkv.flex_attention_backward(g, s, eye, v, scale=1.0, backend="reference")
    return dq


def _stats(scores, weights, s_softmax, v, g):
    """One chunk: ``(sums, grad norms)`` — Σ score, Σ score², Σ max weight, Σ entropy — and ‖∂loss/∂s‖ per row."""
    w = weights
    ent = -np.sum(np.where(w > 0, w * np.log(np.where(w > 0, w, 1.0)), 0.0), axis=-1)
    grad = score_gradient(s_softmax, v, g)
    sums = np.array([scores.sum(), np.square(scores).sum(), w.max(-1).sum(), ent.sum()])
    return sums, np.linalg.norm(grad, axis=-1).ravel()


def run(*, seed: int = 0, d_ks=D_KS, samples: int = 16384, keys: int = 16, values: int = 16, progress=None) -> dict:
    """The scale experiment; plain data (JSON-ready).

    Returns ``{"rows": [{"d_k", "score_var", "score_var_scaled", "max_weight", "max_weight_scaled",
    "entropy", "entropy_scaled", "grad_norm", "grad_norm_scaled"}], "grad_norm_mean": [{"d_k", "grad_norm",
    "grad_norm_scaled"}], "theory": {"score_var": "d_k", "score_var_scaled": 1, "uniform_entropy",
    "uniform_max_weight"}, "settings": {"seed", "samples", "keys", "values"}}`` (see the module doc).
    ``samples`` ≤ 1,048,576, ``keys`` and ``values`` ≤ 1,024; ``progress(n)``, when given, is called with the
    query rows each block computed (``len(d_ks)`` × ``samples`` rounded up to a multiple of ``keys``, in all).
    """
    rng = C.seeded(seed)
    samples = C.positive(samples, "samples", maximum=C.MAX_SAMPLES)
    keys = C.positive(keys, "keys", minimum=2, maximum=C.MAX_KEYS)
    values = C.positive(values, "values", maximum=C.MAX_KEYS)
    if samples * keys > C.MAX_SCALE_SCORES:
        raise ValueError(f"samples, keys: {samples:,} × {keys:,} = {samples * keys:,} scores per d_k, more than the "
                         f"{C.MAX_SCALE_SCORES:,} this experiment computes (its time and memory grow with them); "
                         "give fewer samples or keys")
    d_ks = [C.positive(d, "d_ks", maximum=1 << 16) for d in d_ks]
    if not d_ks:
        raise ValueError("d_ks: expected at least one d_k")
    per = keys                                    # query rows per (batch) item: a keys × keys block
    items = max(1, math.ceil(samples / per))
    rows, grad_means = [], []
    for d in d_ks:
        # about 32 MB of q and k at a time, and of each (n, 1, L, S) array the trace keeps (scores, scaled,
        # weights, the gradient's: ~10 of them): 1,048,576 samples of 1,024 keys took past 8 GB at d_k = 4
        chunk = max(1, min(items, (1 << 21) // (2 * per * d), (1 << 22) // (per * keys)))
        acc = {True: np.zeros(4), False: np.zeros(4)}
        norms = {True: [], False: []}
        done = 0
        while done < items:
            n = min(chunk, items - done)
            q = rng.standard_normal((n, 1, per, d))
            k = rng.standard_normal((n, 1, keys, d))
            v = rng.standard_normal((n, 1, keys, values))
            g = rng.standard_normal((n, 1, per, values))
            for scaled in (False, True):
                with qkv.trace() as tr:
                    qkv.scaled_dot_product_attention(q, k, v, scale=None if scaled else 1.0, backend="reference")
                raw = tr["scores"].array                                   # q·k, (n, 1, L, S)
                s = tr["scaled"].array                                     # what enters the softmax
                sums, gn = _stats(s if scaled else raw, tr["weights"].array, s, v, g)
                acc[scaled] += sums
                norms[scaled].append(gn)
            done += n
            C.tick(progress, n * per)
        N = items * per
        row = {"d_k": d}
        mean_grad = {"d_k": d}
        for scaled, suffix in ((False, ""), (True, "_scaled")):
            tot, sq, mw, ent = acc[scaled]
            mean = tot / (N * keys)
            gn = np.concatenate(norms[scaled])
            row["score_var" + suffix] = C.num(sq / (N * keys) - mean * mean)
            row["max_weight" + suffix] = C.num(mw / N)
            row["entropy" + suffix] = C.num(ent / N)
            row["grad_norm" + suffix] = C.num(np.median(gn))
            mean_grad["grad_norm" + suffix] = C.num(np.mean(gn))
        grad_means.append(mean_grad)
        rows.append({k: row[k] for k in ("d_k", "score_var", "score_var_scaled", "max_weight", "max_weight_scaled",
                                         "entropy", "entropy_scaled", "grad_norm", "grad_norm_scaled")})
    return {"rows": rows,
            "grad_norm_mean": grad_means,
            "theory": {"score_var": "d_k", "score_var_scaled": 1, "uniform_entropy": C.num(math.log(keys)),
                       "uniform_max_weight": C.num(1 / keys)},
            "settings": {"seed": seed, "samples": items * per, "keys": keys, "values": values}}


# ----------------------------------------------------------------------------------------------- presenting
def paragraph(result: dict, lang: str = "en") -> str:
    r = result["rows"]
    lo, hi = r[0], r[-1]
    ratio = lo["grad_norm"] / hi["grad_norm"] if hi["grad_norm"] > 0 else float("inf")
    flat = [x["max_weight_scaled"] for x in r]
    return t("lab.scale_paragraph", lang, d0=lo["d_k"], d1=hi["d_k"], n=result["settings"]["samples"],
             keys=result["settings"]["keys"],
             var0=f"{lo['score_var']:.3g}", var1=f"{hi['score_var']:.4g}",
             svar0=f"{min(x['score_var_scaled'] for x in r):.3f}", svar1=f"{max(x['score_var_scaled'] for x in r):.3f}",
             mw0=f"{lo['max_weight']:.2f}", mw1=f"{hi['max_weight']:.3f}",
             smw0=f"{min(flat):.2f}", smw1=f"{max(flat):.2f}",
             ent0=f"{lo['entropy']:.2f}", ent1=f"{hi['entropy']:.3f}", sent=f"{hi['entropy_scaled']:.2f}",
             g0=f"{lo['grad_norm']:.3g}", g1=f"{hi['grad_norm']:.2g}", orders=f"{math.log10(ratio):.1f}",
             sg0=f"{min(x['grad_norm_scaled'] for x in r):.3g}", sg1=f"{max(x['grad_norm_scaled'] for x in r):.3g}")


def table(result: dict, lang: str = "en"):
    heads = ["d_k", t("lab.col_var", lang), t("lab.col_var_scaled", lang), t("lab.col_max_weight", lang),
             t("lab.col_max_weight_scaled", lang), t("lab.col_entropy", lang), t("lab.col_entropy_scaled", lang),
             t("lab.col_grad", lang), t("lab.col_grad_scaled", lang)]
    rows = [[str(r["d_k"]), f"{r['score_var']:.4g}", f"{r['score_var_scaled']:.4f}", f"{r['max_weight']:.4f}",
             f"{r['max_weight_scaled']:.4f}", f"{r['entropy']:.4f}", f"{r['entropy_scaled']:.4f}",
             f"{r['grad_norm']:.3e}", f"{r['grad_norm_scaled']:.3e}"] for r in result["rows"]]
    return t("lab.scale_title", lang), heads, rows


__all__ = ["run", "paragraph", "table", "score_gradient", "D_KS"]
