"""The page's long-input view: every layer and head of a transformers model on a text of up to 32,768 tokens.

    data = {"long": qkv.viz.long_data(qkv.hf.load(folder), text, rows=[0, 100, -1]), "first": "long"}
    write_page("p.html", data)

No N² weights are held: one forward pass on qkv (``attn_implementation="qkv"``: the tiled engine) records every
head's summary streamed over blocks of query rows (:mod:`qkv.hf._summary`: entropy, mean distance, sink share,
head_kinds' kind and scores, the map max-pooled to at most 256 × 256 cells) and the exact weights of the chosen
query ``rows`` (R × S per head). The page shows the summaries as a table, each head's pooled map on a canvas (a
cell is the largest weight of its block of queries and keys, so a sharp diagonal or a sink column stays
visible) and the chosen rows exactly (to :data:`~qkv.viz.page_maps.MAP_DIGITS` decimals).
"""
from __future__ import annotations

import numpy as np

from qkv.viz.heads import BROAD_MIN, PATTERN_MIN
from qkv.viz.page import MAP_DIGITS, MAX_PAGE_BYTES, MapSet, _model_name

#: The most tokens the long-input view reads (and the model's own context, where that is less).
MAX_TOKENS = 32_768
#: The most exact query rows the page carries (each R × S per head).
MAX_ROWS = 32
#: Decimals of the summaries (entropy, distance, sink share, scores) on the page.
SUMMARY_DIGITS = 4


def encode(model, text: str) -> tuple[np.ndarray, list[str]]:
    """Token ids (T,) and the shown tokens of ``text`` for ``model`` (:class:`qkv.hf.Model`); ValueError naming
    ``text`` when it is empty or longer than the model's context or :data:`MAX_TOKENS` (nothing is cut)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text: expected a non-empty text, got {text[:40]!r}" if isinstance(text, str) else
                         f"text: expected a str, got {type(text).__name__}")
    enc = model.hf_tokenizer([text], return_tensors="np", truncation=False)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)[0]
    limit = min(MAX_TOKENS, int(model.config.context_length))
    if len(ids) > limit:
        whose = (f"the model's context of {model.config.context_length:,} positions"
                 if limit == model.config.context_length else f"the long-input view's limit of {MAX_TOKENS:,}")
        raise ValueError(f"text: {len(ids):,} tokens, over {whose}; shorten the text")
    return ids, model._shown(ids)


def check_rows(rows, T: int) -> list[int]:
    """The chosen query rows in 0 … T−1 (negatives from the end), in the order given; ValueError naming ``rows``."""
    rows = [] if rows is None else list(rows)
    if any(isinstance(r, bool) or not isinstance(r, (int, np.integer)) for r in rows):
        raise TypeError(f"rows: expected ints, got {rows!r:.80}")
    bad = [int(r) for r in rows if not -T <= r < T]
    if bad:
        raise ValueError(f"rows: expected query rows in {-T} … {T - 1} (the text has {T:,} tokens), got {bad}")
    if len(rows) > MAX_ROWS:
        raise ValueError(f"rows: expected at most {MAX_ROWS} rows, got {len(rows)}")
    return [int(r) % T for r in rows]


def record_long(model, ids: np.ndarray, tokens: list[str], rows: list[int], pool: int | None = None):
    """One forward pass of ``model`` on ``ids`` recording every head's summary and the exact ``rows``: a
    :class:`qkv.hf.Recording` (``summaries``, and ``weights`` (1, H, R, S) when rows are chosen)."""
    from qkv.integrations.hf import Recording, Summaries

    rec = Recording(rows=rows or None, model=model.model,
                    summaries=Summaries(tokens=tokens, pool=pool or Summaries.pool))
    model._forward(ids[None, :], np.ones((1, len(ids)), bool), rec)
    return rec


def _round(a, digits: int = SUMMARY_DIGITS) -> list:
    return np.round(np.asarray(a, dtype=np.float64), digits).tolist()


def long_data(model, text: str, *, rows=None, source: str | None = None, name: str | None = None,
              pool: int | None = None) -> dict:
    """The long-input view of ``text`` for ``model`` (:func:`qkv.hf.load`'s :class:`qkv.hf.Model`): see the
    module. ``rows``: query rows to carry exactly (negatives from the end); ``source``: what the page calls the
    input (a file name; default the text's start). ValueError naming ``text`` or ``rows``; PageTooLarge over
    :data:`~qkv.viz.page.MAX_PAGE_BYTES`."""
    ids, tokens = encode(model, text)
    T = len(ids)
    rows = check_rows(rows, T)
    rec = record_long(model, ids, tokens, rows, pool)
    layers = sorted(rec.summaries) if all(isinstance(k, int) for k in rec.summaries) else list(rec.summaries)
    sums = [rec.summaries[i] for i in layers]
    L, H = len(sums), len(sums[0].heads)
    what = f"a text of {T:,} tokens"
    pooled = MapSet(budget=MAX_PAGE_BYTES - 2_000_000, what=what)
    exact = MapSet(thumbs=False, budget=MAX_PAGE_BYTES - 2_000_000, what=what) if rows else None
    for li, s in zip(layers, sums):
        pooled.add_group(list(np.clip(s.pooled[0], 0.0, 1.0)), causal=s.causal and s.rows == s.cols,
                         label=f"layer {li} of {L}")
        if exact is not None:
            exact.add_group(list(rec.weights[li][0]), label=f"the rows of layer {li}")
    first = sums[0]
    return {
        "kind": "long", "name": name or _model_name(model), "T": T, "layers": L, "heads": H,
        "text": source or " ".join(text.split())[:80], "tokens": tokens, "decoder": bool(model.config.decoder),
        "kv_heads": int(model.config.num_kv_heads), "causal": bool(all(s.causal for s in sums)),
        "row_edges": first.row_edges.tolist(), "col_edges": first.col_edges.tolist(),
        "summary": {
            "entropy": [_round(s.entropy[0]) for s in sums], "distance": [_round(s.distance[0]) for s in sums],
            "sink": [_round(s.sink[0]) for s in sums], "kind": [s.kind[0].tolist() for s in sums],
            "scores": [{kd: _round(v[0]) for kd, v in s.scores.items()} for s in sums],
            "digits": SUMMARY_DIGITS, "pattern_min": PATTERN_MIN, "broad_min": BROAD_MIN,
        },
        "digits": MAP_DIGITS, "pooled": pooled.to_json(),
        "rows": rows, "exact": None if exact is None else exact.to_json(),
    }
