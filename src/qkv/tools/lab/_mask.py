"""``qkv lab mask``: why −∞ before the softmax, and not zeroing after it — side by side on a padded batch.

The batch: two sentences padded to 5 tokens, 我 爱 吃 苹果 。 and 你 好 <pad> <pad> <pad>, one attention head
(seeded random embeddings and projections, d = 8), and the mask textbooks build for it: query i may attend to
key j when both are real tokens (``real_i ∧ real_j``) — so each padded query's row is *fully masked*. Four
ways to apply that mask, each through qkv's own attention (:func:`qkv.scaled_dot_product_attention`, its
weights and its backward :func:`qkv.scaled_dot_product_attention_backward`):

* ``-inf``: the masked scores become −∞ before the softmax (qkv's boolean mask);
* ``zero_after``: softmax over every key, then the masked weights set to 0 (no renormalisation);
* ``-1e9``: −1e9 added to the masked scores (float32);
* ``-1e4_fp16``: −1e4 added, everything in float16 (−1e9 does not exist in float16: it becomes −∞).

Measured for each, on the real query rows: the smallest and largest row sum of the weights; the largest weight
on a padding key; the leak — how far the real rows' outputs move when the padding's embeddings are redrawn
(information from padding); the gradient that reaches the padding's keys and values from a loss on the real
rows (qkv's backward; for ``zero_after`` the same attention with the padding's value rows zeroed, which is
what zeroing the weights of padding keys is); the largest difference from ``-inf``'s outputs. And on the fully
masked rows: the sum of their weights and the norm of their outputs (what a padded query passes on).
"""
from __future__ import annotations

import numpy as np

import qkv
from qkv.locales import t
from qkv.tools.lab import common as C

SENTENCES = (("我", "爱", "吃", "苹果", "。"), ("你", "好", "<pad>", "<pad>", "<pad>"))
LENGTHS = (5, 2)
METHODS = ("-inf", "zero_after", "-1e9", "-1e4_fp16")


def _setup(rng, d: int = 8):
    B, T = len(SENTENCES), len(SENTENCES[0])
    x = rng.standard_normal((B, T, d))
    w = [rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(3)]
    g = rng.standard_normal((B, 1, T, d))                       # the upstream gradient of a loss ⟨g, output⟩
    real = np.arange(T)[None, :] < np.array(LENGTHS)[:, None]   # (B, T)
    mask = (real[:, :, None] & real[:, None, :])[:, None]       # (B, 1, T, T): real query ∧ real key
    return x, w, g, real, mask


def _project(x, w):
    q, k, v = (x @ m for m in w)                                # (B, T, d)
    return q[:, None], k[:, None], v[:, None]                   # (B, 1, T, d): one head


def _apply(method: str, x, w, mask, real):
    """``(output, weights, grads)`` of one way of masking; grads = (dq, dk, dv) for the loss ⟨g·[real row], out⟩."""
    q, k, v = _project(x, w)
    if method == "-inf":
        return qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_weights=True), dict(attn_mask=mask)
    if method == "zero_after":
        _, weights = qkv.scaled_dot_product_attention(q, k, v, return_weights=True)
        weights = np.where(mask, weights, 0.0)
        return (weights @ v, weights), None
    if method == "-1e9":
        add = np.where(mask, 0.0, -1e9).astype(np.float32)
        q, k, v = (a.astype(np.float32) for a in (q, k, v))
        return qkv.scaled_dot_product_attention(q, k, v, attn_mask=add, return_weights=True), dict(attn_mask=add)
    if method == "-1e4_fp16":
        add = np.where(mask, 0.0, -1e4).astype(np.float16)
        q, k, v = (a.astype(np.float16) for a in (q, k, v))
        return qkv.scaled_dot_product_attention(q, k, v, attn_mask=add, return_weights=True), dict(attn_mask=add)
    raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")


def _pad_gradient(method, x, w, g, mask, real, how) -> float:
    """‖∂loss/∂(k, v) at the padding positions‖ for loss = ⟨g, output⟩ over the real query rows only."""
    q, k, v = _project(x, w)
    go = np.where(real[:, None, :, None], g, 0.0)                    # the padded rows are not in the loss
    if method == "zero_after":
        # zeroing the weights of padding keys after the softmax = attention without a mask over V with the
        # padding's rows zeroed (for the real query rows, which every real key may be attended by)
        keep = real[:, None, :, None]
        _, dk, dv = qkv.scaled_dot_product_attention_backward(go, q, k, np.where(keep, v, 0.0))
        dv = np.where(keep, dv, 0.0)                                  # v's padding rows do not reach the output
    else:
        dt = {"-inf": np.float64, "-1e9": np.float32, "-1e4_fp16": np.float16}[method]
        q, k, v, go = (a.astype(dt) for a in (q, k, v, go))
        _, dk, dv = qkv.scaled_dot_product_attention_backward(go, q, k, v, **how)
    pad = ~real[:, None, :, None]
    return float(np.sqrt(np.sum(np.where(pad, dk.astype(np.float64), 0) ** 2)
                         + np.sum(np.where(pad, dv.astype(np.float64), 0) ** 2)))


def run(*, seed: int = 0) -> dict:
    """The mask experiment; plain data (JSON-ready).

    Returns ``{"methods": [{"method", "row_sum_min", "row_sum_max", "pad_weight", "leak", "pad_grad",
    "diff_vs_inf", "fully_masked_weight_sum", "fully_masked_output_norm", "fully_masked_uniform"}], "weights": {method: (B, T, T)
    nested lists}, "tokens", "lengths", "float16_of_-1e9", "textbook_softmax_fully_masked", "settings"}``.
    """
    rng = C.seeded(seed)
    x, w, g, real, mask = _setup(rng)
    x2 = np.where(real[..., None], x, rng.standard_normal(x.shape))   # the same batch, other padding vectors
    rows_real = real[:, None, :]                                         # (B, 1, T) the real query rows
    full = ~real[:, None, :]                                             # the fully masked rows
    ref = _apply("-inf", x, w, mask, real)[0][0].astype(np.float64)
    out = {"methods": [], "weights": {}}
    for m in METHODS:
        (o, wt), how = _apply(m, x, w, mask, real)
        o, wt = o.astype(np.float64), wt.astype(np.float64)
        o2 = _apply(m, x2, w, mask, real)[0][0].astype(np.float64)
        sums = wt.sum(-1)                                                # (B, 1, T)
        pad_keys = ~real[:, None, None, :]
        out["methods"].append({
            "method": m,
            "row_sum_min": C.num(sums[rows_real].min()),
            "row_sum_max": C.num(sums[rows_real].max()),
            "pad_weight": C.num(np.where(rows_real[..., None] & pad_keys, wt, 0).max()),
            "leak": C.num(np.abs(np.where(rows_real[..., None], o - o2, 0)).max()),
            "pad_grad": C.num(_pad_gradient(m, x, w, g, mask, real, how)),
            "diff_vs_inf": C.num(np.abs(np.where(rows_real[..., None], o - ref, 0)).max()),
            "fully_masked_weight_sum": C.num(sums[full].max()),
            "fully_masked_output_norm": C.num(np.linalg.norm(o[full[..., None].repeat(o.shape[-1], -1)])),
            "fully_masked_uniform": bool(np.allclose(wt[full[..., None].repeat(wt.shape[-1], -1)], 1 / wt.shape[-1],
                                                     atol=1e-6)),
        })
        out["weights"][m] = [[[C.num(v, 4) for v in row] for row in wt[b, 0]] for b in range(wt.shape[0])]
    with np.errstate(invalid="ignore", over="ignore"):
        f16 = float(np.float16(-1e9))                                    # beyond float16's range: −∞
        s = np.full(3, -np.inf)
        e = np.exp(s - s.max())
        textbook = e / e.sum()                                           # exp(x − max) / Σ: 0/0
    out.update({"tokens": [list(s) for s in SENTENCES], "lengths": list(LENGTHS),
                "float16_of_-1e9": str(f16),
                "textbook_softmax_fully_masked": "nan" if np.isnan(textbook).all() else "finite",
                "settings": {"seed": seed, "d": x.shape[-1]}})
    return out


# ----------------------------------------------------------------------------------------------- presenting
def method_name(method: str, lang: str) -> str:
    """The name of a masking method in ``lang`` (the mask experiment's rows)."""
    return {"-inf": t("lab.mask_inf", lang), "zero_after": t("lab.mask_zero_after", lang),
            "-1e9": t("lab.mask_1e9", lang), "-1e4_fp16": t("lab.mask_1e4", lang)}[method]


def paragraph(result: dict, lang: str = "en") -> str:
    m = {r["method"]: r for r in result["methods"]}
    return t("lab.mask_paragraph", lang, zsum=f"{m['zero_after']['row_sum_min']:.3f}",
             zleak=f"{m['zero_after']['leak']:.3g}", zgrad=f"{m['zero_after']['pad_grad']:.3g}",
             d9=f"{m['-1e9']['diff_vs_inf']:.1g}", d4=f"{m['-1e4_fp16']['diff_vs_inf']:.1g}",
             full9=f"{m['-1e9']['fully_masked_output_norm']:.3g}",
             f16="−∞" if result["float16_of_-1e9"] == "-inf" else result["float16_of_-1e9"])


def table(result: dict, lang: str = "en"):
    heads = [t("lab.col_method", lang), t("lab.col_row_sum", lang), t("lab.col_pad_weight", lang),
             t("lab.col_leak", lang), t("lab.col_pad_grad", lang), t("lab.col_diff", lang),
             t("lab.col_full_sum", lang), t("lab.col_full_norm", lang)]
    rows = [[method_name(r["method"], lang), f"{r['row_sum_min']:.4f}–{r['row_sum_max']:.4f}", f"{r['pad_weight']:.4g}",
             f"{r['leak']:.3g}", f"{r['pad_grad']:.3g}", f"{r['diff_vs_inf']:.2g}",
             f"{r['fully_masked_weight_sum']:.4g}", f"{r['fully_masked_output_norm']:.4g}"]
            for r in result["methods"]]
    return t("lab.mask_title", lang), heads, rows


__all__ = ["run", "paragraph", "table", "METHODS"]
