"""Every head's attention summarised without its N² weights: streamed over blocks of query rows.

    with qkv.hf.record(model, summaries=True) as rec:          # or summaries=qkv.hf.Summaries(tokens=…)
        model(**inputs)
    s = rec.summaries[layer]     # a LayerSummary: (B, h) statistics per head, each head's map max-pooled

For one call of a layer — q (B, Hq, L, E) and k (B, Hk, S, E) as the attention function receives them (after the
positions) — :func:`summarize` computes the weights of :data:`ROW_BLOCK` query rows of one head at a time, exactly as
:meth:`qkv.hf._attention.Spec.weights` computes them (qkv's stages: score, scale, score mod, mask, softmax with the
sinks), folds them into running sums and drops them: memory holds ROW_BLOCK × S weights per block, never L × S.
Where the mask hides every key past some column of a block (causal attention: the keys after the block's last
query), the block is computed up to that column only; the hidden weights are 0 and add nothing to any sum.

Query row i stands at position p_i = i + S − L (L = S without a cache: p_i = i; a cached call's new rows are the
last S − … positions, as causal attention aligns them, bottom-right). Per head, means over the L query rows:

- ``entropy``: −Σ_j w_ij log w_ij (nats; 0 for a row on one key, log n for a row spread evenly over n keys);
- ``distance``: Σ_j w_ij (p_i − j), how far back the weight sits on average (negative: ahead);
- ``sink``: w_i0, the share on the first key;
- ``scores`` and ``kind``: :func:`qkv.viz.head_kinds`'s scores (previous, next, same, sink, long_range, broad)
  and label, from the same sums (qkv.viz sits above qkv.hf, so the thresholds are repeated here; the tests hold
  them equal and the labels equal to head_kinds on the full weights);
- ``pooled``: the head's map max-pooled to at most :data:`POOL` × POOL cells — cell (a, b) holds the largest
  weight of query rows ``row_edges[a] … row_edges[a+1]−1`` on keys ``col_edges[b] … col_edges[b+1]−1`` — so a
  sharp diagonal or a sink column stays visible at any length (a mean would fade it by the block's size).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qkv.core import mods, stages
from qkv.integrations.hf._state import numpy as _numpy

#: Query rows of one head computed at a time: ROW_BLOCK × S float32 weights (32 MiB at S = 32,768) and a few
#: arrays of that size in the softmax.
ROW_BLOCK = 256
#: The most cells a pooled map has on a side.
POOL = 256
#: Added to a weight before its log in the entropy: 0 · log(TINY) = 0, and a weight w ≥ 1e-20 keeps log w to
#: float32's precision (smaller ones add under 1e-18 nats).
TINY = np.float32(1e-30)
#: ``record(model)`` without rows refuses a layer whose (B, heads, L, S) float32 weights pass this many bytes;
#: it says so and offers rows=[…] or summaries=True.
MAX_WEIGHT_BYTES = 1 << 30

# qkv.viz.heads' classifier (head_kinds), repeated: qkv.hf may not import qkv.viz (the layers contract).
PATTERNS = ("previous", "next", "same", "sink", "long_range")
KINDS = PATTERNS + ("broad",)
PATTERN_MIN = 0.5
BROAD_MIN = 0.85
NEAR = 4
SPECIAL_TOKENS = frozenset({"[CLS]", "[SEP]", "<s>", "</s>", "<bos>", "<eos>", "<|endoftext|>", "<|im_start|>",
                            "<|im_end|>", "<|begin_of_text|>"})


@dataclass
class Summaries:
    """How :func:`qkv.hf.record` summarises (``summaries=Summaries(…)``; ``summaries=True`` is the default one).

    Attributes:
        tokens: the S key tokens as strings, for head_kinds' ``same`` (keys holding the query's own token) and its
            special-token sinks; None: ``same`` is the diagonal and the sinks are the first key (as head_kinds
            without tokens).
        pool: the most cells a side of a pooled map (default :data:`POOL`).
        block: query rows per block (default :data:`ROW_BLOCK`).
        near: head_kinds' ``near`` (keys farther than this are long-range; default 4).
    """
    tokens: list | None = None
    pool: int = POOL
    block: int = ROW_BLOCK
    near: int = NEAR

    def __post_init__(self):
        for name in ("pool", "block", "near"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name}: expected a positive integer, got {v!r}")
        if self.tokens is not None:
            if isinstance(self.tokens, str) or not all(isinstance(t, str) for t in self.tokens):
                raise TypeError(f"tokens: expected None or a list of str, got {self.tokens!r:.80}")
            self.tokens = list(self.tokens)


def options(summaries) -> Summaries | None:
    """``record``'s ``summaries=`` argument: False/None (none), True (the defaults) or a :class:`Summaries`."""
    if summaries is None or summaries is False:
        return None
    if summaries is True:
        return Summaries()
    if isinstance(summaries, Summaries):
        return summaries
    raise TypeError(f"summaries: expected True, False or qkv.hf.Summaries(...), got {type(summaries).__name__}")


@dataclass
class LayerSummary:
    """One layer's call, summarised (see the module). Statistics are (B, h) float64 for the h summarised heads.

    Attributes:
        heads: (h,) the query heads summarised.
        entropy, distance, sink: (B, h) means over the query rows (see the module).
        scores: ``{kind: (B, h)}`` head_kinds' scores; kind: (B, h) str, its label.
        pooled: (B, h, P, Q) float32, each head's map max-pooled; row_edges (P + 1,), col_edges (Q + 1,).
        rows, cols: the call's L query rows and S keys; causal: no weight above the diagonal (p_i ≥ j) anywhere.
    """
    heads: np.ndarray
    entropy: np.ndarray
    distance: np.ndarray
    sink: np.ndarray
    scores: dict
    kind: np.ndarray
    pooled: np.ndarray
    row_edges: np.ndarray
    col_edges: np.ndarray
    rows: int
    cols: int
    causal: bool = False
    near: int = NEAR

    def __repr__(self) -> str:
        B, h, P, Q = self.pooled.shape
        return (f"LayerSummary({self.rows} × {self.cols}, B={B}, heads={self.heads.tolist()}, kinds="
                f"{self.kind[0].tolist()}, pooled {P} × {Q})")


def edges(n: int, pool: int) -> np.ndarray:
    """min(n, pool) + 1 edges splitting 0 … n into blocks of ⌊n/P⌋ or ⌈n/P⌉ (n ≤ pool: one per index)."""
    p = min(n, pool)
    return (np.arange(p + 1, dtype=np.int64) * n) // p


def weights_bytes(B: int, heads: int, L: int, S: int) -> int:
    """Bytes of a layer's (B, heads, L, S) float32 weights."""
    return 4 * B * heads * L * S


def check_weights(layer, B: int, heads: int, L: int, S: int, limit: int | None = None) -> None:
    """ValueError naming ``rows`` when a layer's full weights would pass :data:`MAX_WEIGHT_BYTES` (``limit``)."""
    limit = MAX_WEIGHT_BYTES if limit is None else limit
    need = weights_bytes(B, heads, L, S)
    if need > limit:
        raise ValueError(
            f"rows: the weights of every query row of layer {layer} would need {need / 2**30:,.1f} GiB "
            f"(({B}, {heads}, {L}, {S}) float32), over record's limit of {limit / 2**30:g} GiB "
            f"(qkv.hf._summary.MAX_WEIGHT_BYTES); pass rows=[…] (chosen query rows, e.g. rows=[0, -1]) or "
            f"summaries=True (every head's entropy, distance, sink share, kind and pooled map, without the weights)")


#: The running sums :func:`_fold` keeps per head.
SUMS = ("entropy", "distance", "first", "previous", "next", "same", "sink", "long_range", "broad_causal",
        "broad_full")


@dataclass
class _Sums:
    """The running sums of one layer: (B, h) each (all made up front: heads run on several threads, each adding
    to its own column), and the pooled maps."""
    B: int
    h: int
    pooled: np.ndarray
    s: dict = field(default_factory=dict)

    def __post_init__(self):
        self.s = {name: np.zeros((self.B, self.h)) for name in SUMS}

    def add(self, name: str, hi: int, value) -> None:
        self.s[name][:, hi] += value


def summarize(spec, q, k, heads, opts: Summaries) -> LayerSummary:
    """The :class:`LayerSummary` of one call: q (B, Hq, L, E), k (B, Hk, S, E) (NumPy or torch), the query
    ``heads`` (h,) to summarise, ``spec`` the call's :class:`~qkv.hf._attention.Spec` (see the module)."""
    q, k = (x if isinstance(x, np.ndarray) else _numpy(x) for x in (q, k))
    B, Hq, L, _ = q.shape
    S = k.shape[-2]
    heads = np.asarray(heads, dtype=np.int64)
    if opts.tokens is not None and len(opts.tokens) != S:
        raise ValueError(f"tokens: expected {S} tokens (one per key of the call), got {len(opts.tokens)}")
    re, ce = edges(L, opts.pool), edges(S, opts.pool)
    sums = _Sums(B, len(heads), np.zeros((B, len(heads), len(re) - 1, len(ce) - 1), np.float32))
    keys = _KeyInfo(opts.tokens, S, L, opts.near)
    per = max(1, opts.block // max(1, L // (len(re) - 1)))            # pooled rows per block

    def head(hi: int) -> bool:
        # one head's queries and keys contiguous (the tensors are views of (B, L, H, E)): BLAS's GEMM, not a loop
        h = int(heads[hi])
        qh = np.ascontiguousarray(q[:, h:h + 1])                         # (B, 1, L, E)
        kh = np.ascontiguousarray(k[:, h // (Hq // k.shape[1])][:, None])    # (B, 1, S, E)
        upper = False
        for a in range(0, len(re) - 1, per):
            b = min(len(re) - 1, a + per)
            rows = np.arange(re[a], re[b])
            w = block_weights(spec, qh, kh, h, rows, head_axis=0)        # (B, R, c1)
            upper |= _fold(sums, hi, w, rows, keys)
            cols = ce[:-1][ce[:-1] < w.shape[-1]]
            pooled = np.maximum.reduceat(w, re[a:b] - re[a], axis=1)     # (B, b − a, c1): rows first, then keys
            sums.pooled[:, hi, a:b, :cols.size] = np.maximum.reduceat(pooled, cols, axis=-1)
        return upper

    # Heads on the runtime's threads (NumPy releases the GIL), BLAS on one thread each: these GEMMs are thin
    # (E = 16 … 128), and two BLAS threads per call on 2 busy cores ran 8× slower than one (24 vs 3 ms).
    from qkv.engine.backends.runtime import RUNTIME, get_num_threads
    workers = max(1, min(len(heads), get_num_threads()))
    with RUNTIME.blas_single_threaded():
        if workers == 1:
            upper = [head(hi) for hi in range(len(heads))]
        else:
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(workers) as pool:
                upper = list(pool.map(head, range(len(heads))))
    return _finish(sums, heads, L, S, re, ce, causal=not any(upper), near=opts.near)


def block_weights(spec, q: np.ndarray, k: np.ndarray, head: int, rows: np.ndarray, *,
                  head_axis: int | None = None) -> np.ndarray:
    """The weights (B, R, c1) float of query ``rows`` of ``head`` on keys 0 … c1−1, as ``spec.weights(q, k,
    [head], rows)[:, 0, :, :c1]`` computes them, c1 the column after the last key the mask lets any of these rows
    see (S without a boolean mask): the keys after it have weight 0 and are not computed. ``head_axis``: q and k
    hold that head alone, at this index of their head axis (its key/value head already chosen)."""
    B, Hq, _, _ = q.shape
    S = k.shape[-2]
    heads = np.asarray([head], dtype=np.int64)
    at = heads if head_axis is None else np.asarray([head_axis], dtype=np.int64)
    mask = spec.mask_rows(rows, heads)                                   # (B or 1, 1, R, S) or None
    c1 = S
    if mask is not None and mask.dtype == bool:
        seen = np.flatnonzero(mask.any(axis=(0, 1, 2)))
        c1 = int(seen[-1]) + 1 if seen.size else 1
        mask = mask[..., :c1]
    qs = q[:, at][:, :, rows]                                            # (B, 1, R, E)
    ks = k[:, at if head_axis is not None else heads // (Hq // k.shape[1]), :c1]    # (B, 1, c1, E)
    s = stages.scale(stages.score(qs, ks), spec.scale)                   # (B, 1, R, E) x (B, 1, E, c1) -> (B, 1, R, c1)
    if spec.score_mod is not None:
        s = mods.call_score_mod(spec.score_mod, s, np.arange(B).reshape(B, 1, 1, 1), heads.reshape(-1, 1, 1),
                                rows[:, None], np.arange(c1)[None, :])
    s = stages.apply_mask(s, mask)
    sinks = None if spec.sinks is None else _numpy(spec.sinks)[heads].reshape(-1, 1, 1).astype(s.dtype)
    return stages.softmax(s, sinks=sinks)[:, 0]


class _KeyInfo:
    """What the sums need of the keys: token codes (``same``), the sink positions, the query positions' offset."""

    def __init__(self, tokens, S: int, L: int, near: int):
        self.offset, self.near, self.S = S - L, near, S
        if tokens is None:
            self.codes = None
            self.sinks = np.array([0], dtype=np.int64)
        else:
            index: dict = {}
            self.codes = np.array([index.setdefault(t, len(index)) for t in tokens], dtype=np.int64)
            self.sinks = np.array(sorted({0} | {j for j, t in enumerate(tokens) if t in SPECIAL_TOKENS}),
                                  dtype=np.int64)


def _gather(w: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """w[:, r, cols[r, …]] (B, R, …) where 0 ≤ col < c1, else 0 (a key not computed has weight 0)."""
    c1 = w.shape[-1]
    ok = (cols >= 0) & (cols < c1)
    got = np.take_along_axis(w, np.broadcast_to(np.where(ok, cols, 0), w.shape[:1] + cols.shape), axis=-1)
    return np.where(ok, got, 0.0)


def _fold(sums: _Sums, hi: int, w: np.ndarray, rows: np.ndarray, keys: _KeyInfo) -> bool:
    """Add one block's weights w (B, R, c1) of head ``hi`` to the sums; True when a weight lies above the
    diagonal (a key after the query's position)."""
    c1 = w.shape[-1]
    p = rows + keys.offset                                               # (R,) the queries' positions
    ent = -np.einsum("brc,brc->br", w, np.log(w + TINY))                  # (B, R): −Σ w log w (0 log 0 = 0)
    total = w.sum(-1)                                                     # (B, R): 1, or less with sinks
    js = np.arange(c1, dtype=w.dtype)
    sums.add("entropy", hi, ent.sum(-1))
    sums.add("distance", hi, (p * total - w @ js).sum(-1))               # Σ_j w_ij (p_i − j)
    sums.add("first", hi, w[..., 0].sum(-1))
    sums.add("previous", hi, _gather(w, (p - 1)[:, None])[..., 0].sum(-1))
    sums.add("next", hi, _gather(w, np.where(p + 1 < keys.S, p + 1, -1)[:, None])[..., 0].sum(-1))
    if keys.codes is None:
        same = _gather(w, p[:, None])[..., 0]
    else:
        same = np.sum(w, axis=-1, where=keys.codes[p][:, None] == keys.codes[None, :c1])
    sums.add("same", hi, same.sum(-1))
    sink_w = _gather(w, np.broadcast_to(keys.sinks, (len(rows), keys.sinks.size)))    # (B, R, n_sinks)
    sums.add("sink", hi, sink_w.sum((-1, -2)))
    band = p[:, None] + np.arange(-keys.near, keys.near + 1)                           # (R, 2·near + 1)
    near_w = _gather(w, band).sum(-1)
    far_sinks = np.abs(p[:, None] - keys.sinks[None, :]) > keys.near
    far = total - near_w - (sink_w * far_sinks).sum(-1)                               # |p − j| > near, not a sink
    sums.add("long_range", hi, far.sum(-1))
    n = p + 1                                                                          # keys a causal row sees
    sums.add("broad_causal", hi, np.where(n > 1, ent / np.log(np.maximum(n, 2)), 0.0).sum(-1))
    sums.add("broad_full", hi, (ent / np.log(keys.S)).sum(-1) if keys.S > 1 else 0.0)
    j0 = int(p.min()) + 1                                                # keys after the first query's position
    if j0 >= c1:
        return False
    after = np.arange(j0, c1)[None, :] > p[:, None]
    return bool((w[..., j0:] > 0)[:, after].any())


def _finish(sums: _Sums, heads, L: int, S: int, re, ce, *, causal: bool, near: int) -> LayerSummary:
    """Means and labels from the sums (see the module; head_kinds' definitions)."""
    s = sums.s
    pairs = L - 1 if L == S else L                                       # head_kinds: rows 1 … T−1 have a previous
    scores = {
        "previous": s["previous"] / max(1, pairs) if S > 1 else 0 * s["previous"],
        "next": s["next"] / max(1, pairs) if S > 1 else 0 * s["next"],
        "same": s["same"] / L, "sink": s["sink"] / L, "long_range": s["long_range"] / L,
    }
    if causal and S > 1:
        scores["broad"] = s["broad_causal"] / max(1, L - (1 if L == S else 0))
    else:
        scores["broad"] = s["broad_full"] / L if S > 1 else 0 * s["broad_full"]
    scores = {kd: np.clip(scores[kd], 0.0, 1.0) for kd in KINDS}
    return LayerSummary(heads=np.asarray(heads), entropy=s["entropy"] / L, distance=s["distance"] / L,
                        sink=s["first"] / L, scores=scores, kind=label(scores), pooled=sums.pooled,
                        row_edges=re, col_edges=ce, rows=L, cols=S, causal=causal, near=near)


def label(scores: dict) -> np.ndarray:
    """head_kinds' label of each head from its scores: the largest pattern score when ≥ PATTERN_MIN, else
    ``broad`` when its score ≥ BROAD_MIN, else ``mixed``."""
    stack = np.stack([scores[kd] for kd in PATTERNS])                    # (5, B, h)
    kind = np.array(PATTERNS, dtype=object)[stack.argmax(0)]
    kind = np.where(stack.max(0) >= PATTERN_MIN, kind,
                    np.where(scores["broad"] >= BROAD_MIN, "broad", "mixed"))
    return kind.astype(str)
