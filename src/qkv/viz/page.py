"""The offline attention page: one self-contained HTML file (inline CSS and JavaScript, data as JSON).

    data = playground_data(X, W_Q, W_K, W_V, tokens=[...])     # or from_worked(worked)
    data["model"] = model_data("a sentence")                    # optional, needs the ``model`` extra
    write_page("attention.html", data)

The page recomputes the playground in JavaScript (the one computation outside qkv's Python stages; the
browser tests hold it to qkv's numbers). The model view only draws what :mod:`qkv.models` computed here.

Safety: the data goes into ``<script type="application/json">`` with ``<``, ``>``, ``&`` and the line
separators escaped as ``\\uXXXX``, so no string can close the tag; the page's JavaScript inserts all text with
``textContent``; a Content-Security-Policy allows only the page's own script (by hash) and no network access.
"""
from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import re
from importlib import resources

import numpy as np

from qkv._files import atomic_write
from qkv.viz.page_data import in_language, normalize, words
from qkv.viz.page_maps import MAP_DIGITS, THUMB, _encode_group, _lengths, _symbols, _thumb, decode_maps, quantize  # noqa: F401

#: Decimals shown in the playground's cells (the browser tests compare at this precision).
DIGITS = 4
#: Decimals shown in the model view's heatmap.
MODEL_DIGITS = 3

_PLACEHOLDER = re.compile(r"\{\{(CSS|JS|DATA|TITLE|VERSION|SCRIPT_HASH)\}\}")


def _asset(name: str) -> str:
    return resources.files("qkv.viz").joinpath("page", name).read_text(encoding="utf-8")


def _matrix(a, name: str, *, rows: int | None = None, cols: int | None = None) -> list[list[float]]:
    arr = np.asarray(a, dtype=np.float64)
    if arr.ndim != 2 or 0 in arr.shape:
        raise ValueError(f"{name}: expected a non-empty 2-D matrix, got shape {arr.shape}")
    if rows is not None and arr.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} rows, got shape {arr.shape}")
    if cols is not None and arr.shape[1] != cols:
        raise ValueError(f"{name}: expected {cols} columns, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: expected finite numbers")
    return arr.tolist()


def _tokens(tokens, n: int, name: str) -> list[str]:
    if tokens is None:
        return [f"t{i}" for i in range(n)]
    tokens = [str(t) for t in tokens]
    if len(tokens) != n:
        raise ValueError(f"{name}: expected {n} tokens (one per row of the input), got {len(tokens)}")
    return tokens


def _start(X, W_Q, W_K, W_V, Q, K, V, scores, d_k, X_kv) -> tuple:
    """The playground's starting point, checked: (start, L, S, X, X_kv, W_Q, W_K, W_V, Q, K, V, scores)."""
    if X is not None:
        start = "X"
        if W_Q is None or W_K is None or W_V is None:
            raise ValueError("W_Q, W_K, W_V: expected all three with X")
        Xl = _matrix(X, "X")
        L, D = len(Xl), len(Xl[0])
        Xkv = None if X_kv is None else _matrix(X_kv, "X_kv")
        S, Dkv = (L, D) if Xkv is None else (len(Xkv), len(Xkv[0]))
        wq = _matrix(W_Q, "W_Q", rows=D)
        wk = _matrix(W_K, "W_K", rows=Dkv, cols=len(wq[0]))
        wv = _matrix(W_V, "W_V", rows=Dkv)
        q = k = v = sc = None
    elif Q is not None:
        start = "QK"
        if K is None:
            raise ValueError("K: expected K with Q")
        q = _matrix(Q, "Q")
        k = _matrix(K, "K", cols=len(q[0]))
        L, S = len(q), len(k)
        v = None if V is None else _matrix(V, "V", rows=S)
        Xl = Xkv = wq = wk = wv = sc = None
    elif scores is not None:
        start = "scores"
        sc = _matrix(scores, "scores")
        L, S = len(sc), len(sc[0])
        if d_k is None:
            raise ValueError("d_k: expected the d_k of the given scores (scaled = scores / √d_k)")
        v = None if V is None else _matrix(V, "V", rows=S)
        Xl = Xkv = wq = wk = wv = q = k = None
    else:
        raise ValueError("expected a starting point: X (with W_Q, W_K, W_V), Q and K, or scores")
    return start, L, S, Xl, Xkv, wq, wk, wv, q, k, v, sc


def _mask_rows(mask, causal: bool, L: int, S: int) -> tuple[bool, list | None]:
    """The playground's mask, checked: (causal, the boolean (L, S) rows or None)."""
    m = None
    if isinstance(mask, str):
        if mask.strip().lower() != "causal":
            raise ValueError(f"mask: expected 'causal', a boolean array or None, got {mask!r}")
        causal, mask = True, None
    if mask is not None:
        marr = np.asarray(mask)
        while marr.ndim > 2 and marr.shape[0] == 1:
            marr = marr[0]
        if marr.dtype != np.bool_:
            if marr.dtype.kind != "f" or not np.all((marr == 0) | np.isneginf(marr)):
                raise ValueError("mask: the page shows a boolean mask (True = may attend) or a float mask of "
                                 "0 and -inf; got another float mask")
            marr = marr == 0
        if marr.shape != (L, S):
            raise ValueError(f"mask: expected shape {(L, S)}, got {marr.shape}")
        m = marr.tolist()
    return causal, m


def playground_data(X=None, W_Q=None, W_K=None, W_V=None, *, Q=None, K=None, V=None, scores=None,
                    d_k: float | None = None, tokens=None, X_kv=None, kv_tokens=None, W_O=None, mask=None,
                    heads: int = 1, causal: bool = False, scaling: bool = True, title: str | None = None,
                    rope: dict | None = None, alibi=None, softcap: float | None = None, sink_logits=None) -> dict:
    """The playground's starting point, checked. It starts from one of

    - token vectors: ``X`` (L, D), ``W_Q``/``W_K`` (D, H·E), ``W_V`` (D, H·Ev), optional ``X_kv`` (S, D_kv)
      for cross-attention and ``W_O`` (H·Ev, D_out);
    - ``Q`` (L, E) and ``K`` (S, E), optional ``V`` (S, Ev);
    - ``scores`` (L, S) and ``d_k``, optional ``V`` (S, Ev).

    ``mask``: boolean (L, S), True = may attend (a float mask of 0 / -inf is converted), or ``"causal"``.
    ``d_k``: the √d_k divisor when it is not the width of a head. ``heads`` > 1 only from token vectors.

    The variants of the worked-example files: ``rope`` ``{"theta", "style", "positions", "kv_positions"}``
    (Q and K turned per head before the scores), ``alibi`` ``"auto"`` (slopes from the head count) or one
    slope per head, ``softcap`` c (``c·tanh(s / c)``), ``sink_logits`` one per head (softmax sinks).
    """
    start, L, S, Xl, Xkv, wq, wk, wv, q, k, v, sc = _start(X, W_Q, W_K, W_V, Q, K, V, scores, d_k, X_kv)
    if d_k is not None:
        d_k = float(d_k)
        if not (math.isfinite(d_k) and d_k > 0):
            raise ValueError(f"d_k: expected a positive number, got {d_k}")
        d_k = int(d_k) if d_k.is_integer() else d_k
    heads = int(heads or 1)
    width_q = len(wq[0]) if wq else None
    width_v = len(wv[0]) if wv else None
    if heads != 1 and (start != "X" or len(wq[0]) % heads or len(wv[0]) % heads):
        raise ValueError(f"heads: expected a number of heads dividing the widths of W_Q ({width_q}) and "
                         f"W_V ({width_v}), got {heads}")
    out_width = width_v if start == "X" else (len(v[0]) if v else None)
    wo = None
    if W_O is not None:
        if out_width is None:
            raise ValueError("W_O: expected no W_O without values")
        wo = _matrix(W_O, "W_O", rows=out_width)
    causal, m = _mask_rows(mask, causal, L, S)
    variants = _variants(start, rope, alibi, softcap, sink_logits, heads, L, S,
                         width_q if start == "X" else (len(q[0]) if q else None))
    cross = Xkv is not None or kv_tokens is not None or (start != "X" and S != L)
    return {"title": title or "Attention playground", "titles": None if title else words("page.playground_title"),
            "start": start, "tokens": _tokens(tokens, L, "tokens"),
            "kv_tokens": _tokens(kv_tokens, S, "kv_tokens") if cross else None,
            "X": Xl, "X_kv": Xkv, "W_Q": wq, "W_K": wk, "W_V": wv, "Q": q, "K": k, "V": v, "scores": sc, "d_k": d_k,
            "W_O": wo, "mask": m, "heads": heads, "causal": bool(causal), "scaling": bool(scaling), **variants}


def _variants(start, rope, alibi, softcap, sink_logits, heads: int, L: int, S: int, width) -> dict:
    """The variant fields of the playground data, checked (see :func:`playground_data`)."""
    out = {"rope": None, "alibi": None, "softcap": None, "sink_logits": None}
    if rope is not None:
        if start == "scores" or width is None:
            raise ValueError("rope: expected Q and K (token vectors or Q/K given), got a start from scores")
        if not isinstance(rope, dict) or set(rope) - {"theta", "style", "positions", "kv_positions"}:
            raise ValueError(f"rope: expected a dict with theta, style (and positions, kv_positions), got {rope!r}")
        theta = float(rope.get("theta", 10000.0))
        style = rope.get("style", "neox")
        if not (math.isfinite(theta) and theta > 0) or style not in ("neox", "interleaved"):
            raise ValueError(f"rope: expected theta > 0 and style neox or interleaved, got {rope!r}")
        if (width // heads) % 2:
            raise ValueError(f"rope: expected an even head width, got {width // heads}")
        pos = {}
        for key, n in (("positions", L), ("kv_positions", S)):
            v = rope.get(key)
            if v is not None:
                v = [int(x) for x in np.asarray(v).ravel()]
                if len(v) != n or min(v) < 0:
                    raise ValueError(f"rope.{key}: expected {n} non-negative integers, got {v}")
            pos[key] = v
        out["rope"] = {"theta": theta, "style": style, **pos}
    if alibi is not None:
        if isinstance(alibi, str) and alibi == "auto":
            out["alibi"] = "auto"
        else:
            a = [float(x) for x in np.asarray(alibi, dtype=np.float64).ravel()]
            if len(a) != heads or not all(math.isfinite(x) for x in a):
                raise ValueError(f"alibi: expected 'auto' or {heads} finite slopes (one per head), got {alibi!r}")
            out["alibi"] = a
    if softcap is not None:
        c = float(softcap)
        if not (math.isfinite(c) and c > 0):
            raise ValueError(f"softcap: expected a finite number > 0, got {softcap!r}")
        out["softcap"] = c
    if sink_logits is not None:
        z = [float(x) for x in np.asarray(sink_logits, dtype=np.float64).ravel()]
        if len(z) != heads or not all(math.isfinite(x) for x in z):
            raise ValueError(f"sink_logits: expected {heads} finite numbers (one per head), got {sink_logits!r}")
        out["sink_logits"] = z
    return out


def from_worked(worked, *, tokens=None) -> dict:
    """Playground data from a worked example (``qkv.explain.examples.Worked``); ``tokens`` relabels it."""
    heads = getattr(worked, "heads", None) or 1
    kv = getattr(worked, "kv_tokens", None)
    rope = getattr(worked, "rope", None)
    if rope is not None:
        rope = dict(rope, positions=getattr(worked, "positions", None),
                    kv_positions=getattr(worked, "kv_positions", None))
    alibi = getattr(worked, "alibi", None)
    mask = worked.mask_matrix() if hasattr(worked, "mask_matrix") else worked.mask   # window, documents, … too
    causal = False
    if isinstance(mask, np.ndarray) and isinstance(worked.mask, str) and worked.mask == "causal":
        L, S = mask.shape
        causal = not np.any(mask & ~np.tri(L, S, dtype=bool))   # the page's causal toggle stays on when it fits
    from qkv.explain.examples import titles

    pg = playground_data(worked.X, worked.W_Q, worked.W_K, worked.W_V, Q=worked.Q, K=worked.K, V=worked.V,
                         scores=worked.scores, d_k=worked.d_k, tokens=tokens if tokens is not None else worked.tokens,
                         X_kv=worked.X_kv, kv_tokens=kv, W_O=worked.W_O if heads > 1 else None,
                         mask=mask, causal=causal, heads=heads, title=worked.title, rope=rope,
                         alibi="auto" if alibi is True else alibi, softcap=getattr(worked, "softcap", None),
                         sink_logits=getattr(worked, "sink_logits", None))
    return dict(pg, titles=titles(worked) or pg["titles"])        # a built-in's title in every language


# ---------------------------------------------------------------------------------------------- maps
# The map code (MapSet's tables and blobs) is in page_maps.py.
#: The most weights the canvas views of one page hold (layers × heads × stored cells): SmolLM2's 30 × 9 heads at
#: 1,024 tokens (causal: 141.7M) fit.
MAX_CELLS = 150_000_000
#: The largest page :func:`render_page` writes (bytes of UTF-8).
MAX_PAGE_BYTES = 30_000_000
#: The editable playground up to this many displayed cells (inputs and results); beyond, a worked example's
#: weights are shown in the canvas view instead (the playground computes and lays out every cell in the page).
PLAYGROUND_MAX_CELLS = 20_000
#: A worked example's weights in the canvas view up to this many queries or keys.
EXAMPLE_MAX_TOKENS = 2048
#: Up to this many tokens the model view also draws lines between the tokens and a table of the numbers.
SMALL_TOKENS = 32
#: The model view shows attention flow (:func:`qkv.viz.attention_flow`: one networkx max-flow per query and
#: token, all queries) up to this :func:`qkv.viz.heads.flow_work`; beyond, the page says so with the limit.
#: Measured on the 2-core test machine (busy, load ≈ 7): MiniLM's 6 layers × 12 tokens (work 124,416) 5.4 s,
#: 9 tokens (39,366) 2.5 s, 14 tokens (230,496) 5.3–12 s; real attention graphs cost about twice random ones. So
#: MiniLM up to 12 tokens, SmolLM2's 30 layers up to 8.
PAGE_FLOW_WORK = 130_000

class PageTooLarge(ValueError):
    """What was asked for is over one of the page's limits; the message names the size and the limit."""


class MapSet:
    """Maps (2-D attention weights) added a group at a time (each group shares a frequency table), coded for the
    page as they come, within a byte budget. ``to_json()`` is what page.js reads."""

    def __init__(self, *, digits: int = MAP_DIGITS, thumbs: bool = True, budget: int | None = None,
                 what: str = "the page"):
        self.digits, self.want_thumbs, self.budget, self.what = digits, thumbs, budget, what
        self.tables: list[str] = []
        self.table_of: list[int] = []
        self.blobs: list[str] = []
        self.shapes: list[list[int]] = []
        self.causal: list[bool] = []
        self.thumbs: list[bytes] = []
        self.thumb_shapes: list[list[int]] = []
        self.size = 0

    def add_group(self, weights, *, causal: bool = False, label: str = "") -> None:
        """``weights``: 2-D arrays (or one 3-D array) of attention weights in [0, 1]. ``causal``: only
        j ≤ i is stored (the rest must be 0, as a causal softmax leaves it)."""
        ks = [quantize(w, self.digits) for w in weights]
        if any(k.ndim != 2 or 0 in k.shape for k in ks):
            raise ValueError("weights: expected non-empty 2-D maps")
        table, blobs = _encode_group(ks, [causal] * len(ks), self.digits)
        g = len(self.tables)
        self.tables.append(base64.b64encode(table).decode("ascii"))
        self.size += len(self.tables[-1])
        for k, blob in zip(ks, blobs):
            self.blobs.append(base64.b64encode(blob).decode("ascii"))
            self.size += len(self.blobs[-1]) + 16
            self.table_of.append(g)
            self.shapes.append([int(k.shape[0]), int(k.shape[1])])
            self.causal.append(bool(causal))
            if self.want_thumbs:
                t = _thumb(k, self.digits)
                self.thumbs.append(t.tobytes())
                self.thumb_shapes.append([int(t.shape[0]), int(t.shape[1])])
                self.size += t.size * 4 // 3
        if self.budget is not None and self.size > self.budget:
            raise PageTooLarge(f"{self.what}: the page would pass its limit of {MAX_PAGE_BYTES / 1e6:g} MB "
                               f"({self.size / 1e6:.1f} MB of weights after {label or f'{len(self.blobs)} maps'})")

    def to_json(self) -> dict:
        return {"digits": self.digits, "ns": _symbols(self.digits), "tables": self.tables,
                "table_of": self.table_of, "blobs": self.blobs, "shapes": self.shapes, "causal": self.causal,
                "thumbs": base64.b64encode(b"".join(self.thumbs)).decode("ascii") if self.thumbs else None,
                "thumb_shapes": self.thumb_shapes or None}


def _model_name(model) -> str:
    try:
        from qkv.viz.heads import model_name
    except ImportError:                                          # pragma: no cover - heads.py not there yet
        return str(getattr(getattr(model, "config", None), "name", "") or type(model).__name__)
    return model_name(model)


def _is_decoder(model) -> bool:
    return hasattr(model, "generate") and hasattr(model, "embed")


def _check_cells(maps: int, rows: int, cols: int, causal: bool, what: str) -> int:
    """The stored weights of ``maps`` maps of rows × cols; PageTooLarge beyond :data:`MAX_CELLS`."""
    cells = maps * int(_lengths(rows, cols, causal).sum())
    if cells > MAX_CELLS:
        raise PageTooLarge(f"{what}: {maps} maps of {rows} × {cols} tokens are {cells:,} weights; the page holds "
                           f"at most {MAX_CELLS:,} (e.g. 1,024 tokens × 30 layers × 9 heads of a decoder)")
    return cells


def decoder_attentions(model, ids):
    """Per layer, the attention weights (H, T, T) float32 of a decoder (:func:`qkv.models.load_llama`) on one
    sequence of token ids: the layers exactly as :meth:`LlamaModel.run` runs them (each layer's attention through
    its traced :class:`qkv.MultiHeadAttention`, causal), one layer at a time so that memory holds one layer's
    weights, on ids rather than a text (a continuation is not always its text's tokenization)."""
    from qkv.core.tracing import Trace

    x = model.embed(np.asarray([list(ids)], dtype=np.int64))
    for layer in model._layers:
        t = Trace()
        x = model._layer(x, layer, trace=t)
        w = t["weights"].array[0]
        del t
        yield w


def model_data(text: str, *, model=None, digits: int = 6, name: str | None = None) -> dict:
    """Attention weights of every layer and head of ``qkv.models.load_bert()`` (or ``model``: a BERT model or a
    decoder from :func:`qkv.models.load_llama`) for one text, for the page's model view.

    The weights are coded compactly (:class:`MapSet`: each to :data:`MAP_DIGITS` decimals, exactly); texts of up
    to :data:`SMALL_TOKENS` tokens also carry them as numbers (``attentions``, ``digits`` decimals) for the
    lines and the table. PageTooLarge (a ValueError naming the limit) when the text is over the page's limits.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text: expected a non-empty sentence, got {text!r}")
    if model is None:
        try:
            from qkv.models import load_bert
        except ImportError as exc:
            raise ImportError(f"the model view needs qkv.models and the model extra: pip install 'qkv[model]' "
                              f"({exc})") from None
        model = load_bert()
    c = model.config
    L, H = int(c.num_layers), int(c.num_heads)
    if _is_decoder(model):
        ids = model.encode(text)
        if len(ids) > c.context_length:
            raise ValueError(f"text: {len(ids)} tokens, longer than the model's context of {c.context_length}")
        tokens = [str(t) for t in model.token_texts(ids)]
        T, causal = len(ids), True
        _check_cells(L * H, T, T, causal, f"text of {T:,} tokens")
        layers = decoder_attentions(model, ids)
    else:
        out = model.run([text])                                    # BERT, or a transformers folder (qkv.hf)
        T, causal = int(np.asarray(out.attention_mask)[0].sum()), getattr(c, "decoder", False) is True
        tokens = [str(t) for t in out.tokens[0][:T]]
        _check_cells(L * H, T, T, causal, f"text of {T:,} tokens")
        layers = (np.asarray(a)[0, :, :T, :T] for a in out.attentions)
    data = _layers_data(layers, L, H, T, causal, what=f"a text of {T:,} tokens", small_digits=digits, tokens=tokens)
    data.update({"kind": "model", "name": name or _model_name(model), "text": text, "tokens": tokens,
                 "decoder": causal, "kv_heads": int(getattr(c, "num_kv_heads", H) or H),
                 "source": "qkv.hf" if type(model).__module__.startswith("qkv.integrations.hf") else "qkv.models"})
    return data


def _layers_data(layers, L: int, H: int, T: int, causal: bool, *, what: str, small_digits: int = 6,
                 cols: int | None = None, tokens=None) -> dict:
    """The map set of ``L`` layers of ``H`` heads (each (H, T, S)), with the numbers when small. With ``tokens``
    (a model's self-attention) also every head's kind (:func:`qkv.viz.head_kinds`, layer by layer) and the
    attention rollout through the layers (:func:`qkv.viz.rollout`, multiplied up layer by layer), so that
    memory holds one layer's weights at a time; and the attention flow (:func:`qkv.viz.attention_flow`, every
    query) when it is small enough (:func:`flow_limit`), else ``flow_limit`` says why it is not there."""
    ms = MapSet(budget=MAX_PAGE_BYTES - 1_000_000, what=what)
    small = T <= SMALL_TOKENS and (cols or T) <= SMALL_TOKENS
    exact = []
    analysis = tokens is not None and (cols is None or cols == T)
    if analysis:
        from qkv.viz import heads as _heads
        kinds, scores, R = [], [], None
        limit = flow_limit(L)
        kept = [] if T <= limit else None                            # the layers again, for the max-flow graph
    for li, a in enumerate(layers):
        a = np.asarray(a)
        ms.add_group(list(a), causal=causal, label=f"layer {li + 1} of {L}")
        if small:
            exact.append(np.round(a.astype(np.float64), small_digits).tolist())
        if analysis:
            k = _heads.head_kinds([a], tokens, causal=causal)
            kinds.append([str(x) for x in k.kind[0]])
            scores.append({name: [round(float(v), 4) for v in sc[0]] for name, sc in k.scores.items()})
            step = _heads.rollout([a])                               # this layer's Ã (heads fused, + I, renormalised)
            R = step if R is None else step @ R
            if kept is not None:
                kept.append(a)
    if len(ms.blobs) != L * H:
        raise ValueError(f"layers: expected {L} layers of {H} heads, got {len(ms.blobs)} maps")
    out = {"layers": L, "heads": H, "T": T, "causal": causal, "digits": MAP_DIGITS, "maps": ms.to_json(),
           "attentions": exact if small else None, "head_kinds": None, "rollout": None, "flow": None,
           "flow_limit": None}
    if analysis:
        roll = MapSet(thumbs=False, what=what)
        roll.add_group([np.clip(R, 0.0, 1.0)], causal=causal, label="rollout")
        out["head_kinds"] = {"kind": kinds, "scores": scores, "pattern_min": _heads.PATTERN_MIN,
                             "broad_min": _heads.BROAD_MIN}
        out["rollout"] = roll.to_json()
        out["flow"], out["flow_limit"] = _flow_maps(kept, L, limit, causal, what)
    return out


def flow_limit(layers: int) -> int:
    """The most tokens whose attention flow through ``layers`` layers the page computes (:data:`PAGE_FLOW_WORK`)."""
    from qkv.viz.heads import flow_work

    T = 0
    while flow_work(layers, T + 1) <= PAGE_FLOW_WORK:
        T += 1
    return T


def _flow_maps(kept, L: int, limit: int, causal: bool, what: str):
    """``(flow map set, None)``: :func:`qkv.viz.attention_flow` of the ``kept`` layers (mean fusion, residual, as
    the rollout) as one map; or ``(None, {"reason", "limit", "layers"})`` when it is not computed: over the size
    limit (``kept`` is None) or networkx missing."""
    from qkv.viz.heads import attention_flow

    why = {"reason": "size", "limit": limit, "layers": L}
    if kept is None:
        return None, why
    try:
        F = attention_flow(kept)                                           # (T, T), rows sum to 1
    except ImportError:
        return None, dict(why, reason="networkx")
    flow = MapSet(thumbs=False, what=what)
    flow.add_group([np.clip(F, 0.0, 1.0)], causal=causal, label="flow")
    return flow.to_json(), None


def _playground_cells(pg: dict) -> int:
    """About how many cells the playground lays out for ``pg`` (inputs and results)."""
    L = len(pg["tokens"])
    S = len(pg["kv_tokens"]) if pg.get("kv_tokens") else L
    size = lambda m: len(m) * len(m[0]) if m else 0           # noqa: E731
    inputs = sum(size(pg.get(n)) for n in ("X", "X_kv", "W_Q", "W_K", "W_V", "Q", "K", "V", "scores", "W_O"))
    wq = len(pg["W_Q"][0]) if pg.get("W_Q") else (len(pg["Q"][0]) if pg.get("Q") else 0)
    wv = len(pg["W_V"][0]) if pg.get("W_V") else (len(pg["V"][0]) if pg.get("V") else 0)
    return inputs + L * wq + S * wq + S * wv + 7 * L * S + L * wv


def _notice(key: str, **args) -> dict:
    return {"key": key, "args": args}


def worked_data(worked, *, tokens=None) -> dict:
    """Page data for a worked example at any size: the editable playground (:func:`from_worked`) when it is
    small enough (:data:`PLAYGROUND_MAX_CELLS`); otherwise its weights, computed by qkv
    (:func:`qkv.explain.examples.run`), in the canvas view, with a notice saying why; beyond
    :data:`EXAMPLE_MAX_TOKENS` queries or keys, only the notice. Returns the value of the page's ``"example"``
    (:mod:`qkv.viz.page_data`): the playground's dict (``kind`` "playground"), the canvas view's with its
    ``notices``, or ``{"kind": "notice", "notices": […]}``."""
    pg = from_worked(worked, tokens=tokens)
    cells = _playground_cells(pg)
    if cells <= PLAYGROUND_MAX_CELLS:
        from qkv.explain import examples
        examples.run(worked)              # the start the page computes in JavaScript, checked as explain checks
        return dict(pg, kind="playground")                       # it (numbers that overflow: one error)
    L = len(pg["tokens"])
    S = len(pg["kv_tokens"]) if pg.get("kv_tokens") else L
    if max(L, S) > EXAMPLE_MAX_TOKENS:
        return {"kind": "notice", "notices": [
            _notice("page.example_too_big", title=pg["title"], L=L, S=S, limit=EXAMPLE_MAX_TOKENS)]}
    from qkv.explain import examples

    w = np.asarray(examples.run(worked)["weights"].array)
    w = w.reshape(-1, w.shape[-2], w.shape[-1])                    # (heads, L, S)
    data = _layers_data([w], 1, w.shape[0], L, False, what=f"{pg['title']}", cols=S)
    data.update({"kind": "example", "name": pg["title"], "text": None, "tokens": pg["tokens"],
                 "kv_tokens": pg["kv_tokens"], "decoder": False, "titles": pg["titles"],
                 "notices": [_notice("page.playground_too_big", cells=cells, limit=PLAYGROUND_MAX_CELLS)]})
    return data


def generation_data(model, prompt: str, *, max_new_tokens: int = 32, chat: bool = False, **sampling) -> dict:
    """Generate with a decoder (:func:`qkv.models.load_llama`) and keep, for every generated token, its attention
    row over the earlier tokens in every layer and head (the page's generation view).

    ``model.generate`` writes the continuation (``sampling``: temperature, top_k, top_p, seed). The rows then
    come from one pass of the decoder's layers over prompt + continuation (:func:`decoder_attentions`):
    generate's cached steps keep no weights, and with a causal mask the row of a token in the full pass is the
    row that token's step computed (each query sees the same keys). The row of generated token s is that of
    the token itself as the query (position P + s). Returns the value of the page's ``"generation"``, with the
    model view of the whole sequence under ``"model"`` (the page shows it as its model view).
    """
    g = model.generate(prompt, max_new_tokens=max_new_tokens, chat=chat, **sampling)
    c = model.config
    return steps_view(model, g, prompt, chat, lambda ids: decoder_attentions(model, ids),
                      lambda ids: [str(t) for t in model.token_texts(ids)],
                      kv_heads=int(getattr(c, "num_kv_heads", c.num_heads) or c.num_heads))


def steps_view(model, g, prompt: str, chat: bool, attentions, shown, *, kv_heads: int, source: str | None = None) -> dict:
    """The page's ``"generation"`` value of a generation ``g`` (``prompt_ids``, ``ids``, ``prompt``, ``text``,
    ``finish_reason``) by ``model`` (its ``config``: layers, heads): ``attentions(ids)`` yields each layer's
    (H, T, T) weights over prompt + continuation, ``shown(ids)`` the tokens as the page shows them. Every
    generated token's row (generated token s: the query at position P + s) in every layer and head, and the
    sequence's model view under ``"model"``; ``source`` (e.g. ``"qkv.hf"``) says where the weights came from."""
    ids = list(g.prompt_ids) + list(g.ids)
    P, G, T = len(g.prompt_ids), len(g.ids), len(g.prompt_ids) + len(g.ids)
    L, H = int(model.config.num_layers), int(model.config.num_heads)
    what = f"prompt and continuation of {T:,} tokens"
    _check_cells(L * H, T, T, True, what)
    tokens = shown(ids)
    rows = [np.zeros((L * H, P + s + 1), np.float32) for s in range(G)]       # step s: (L·H, P + s + 1)

    def layers():
        for li, a in enumerate(attentions(ids)):                              # a: (H, T, T)
            for s in range(G):
                rows[s][li * H:(li + 1) * H] = a[:, P + s, :P + s + 1]
            yield a

    view = _layers_data(layers(), L, H, T, True, what=what, tokens=tokens)
    view["attentions"] = None
    size = sum(len(b) for b in view["maps"]["blobs"])
    steps = MapSet(thumbs=False, budget=MAX_PAGE_BYTES - 1_000_000 - size, what=what)
    steps.add_group(rows, label="the generated tokens' rows")
    name = _model_name(model)
    view.update({"kind": "model", "name": name, "text": g.prompt, "tokens": tokens, "decoder": True,
                 "kv_heads": kv_heads})
    gen = {"name": name, "prompt": prompt, "chat": bool(chat), "text": g.text, "finish": g.finish_reason,
           "tokens": tokens, "prompt_len": P, "layers": L, "heads": H, "digits": MAP_DIGITS, "steps": steps.to_json(),
           "model": view}
    if source is not None:
        view["source"] = gen["source"] = source
    return gen


# ---------------------------------------------------------------------------------------------- why
#: Query rows per d_k of the page's scale experiment (``qkv lab scale`` runs 16,384): ≈ 0.9 s on the 2-core
#: test machine, variances within about 3 % of theory.
WHY_SAMPLES = 4096
#: The words of ``qkv lab scale`` the section shares (its table's and plot's labels), embedded with it.
WHY_LAB_KEYS = ("lab.unscaled", "lab.scaled", "lab.col_var", "lab.col_max_weight", "lab.col_entropy", "lab.col_grad")


def why_data(*, seed: int = 0, samples: int = WHY_SAMPLES) -> dict:
    """The page's "Why ÷ √d_k" section: :func:`qkv.lab.scale` (``seed``, ``samples`` query rows per d_k) as it
    returns it, and for each of its d_k one sampled query row against the same number of keys through
    :func:`qkv.scaled_dot_product_attention` with ``scale=1`` and with the default 1/√d_k (the stages recorded in
    a :class:`qkv.Trace`): ``{"scale": …, "examples": [{"d_k", "scores", "scaled", "weights",
    "weights_scaled"}], "seed", "samples"}``. The page only draws these numbers; :func:`render_page` adds the
    lab's paragraph (:func:`qkv.lab.paragraph`) in the page's language."""
    import qkv
    from qkv.tools import lab

    result = lab.scale(seed=seed, samples=samples)                # checks seed and samples
    keys = result["settings"]["keys"]
    examples = []
    for row in result["rows"]:
        d = row["d_k"]
        rng = np.random.default_rng([seed, d])                    # one row per d_k, independent of the others
        q = rng.standard_normal((1, 1, 1, d))                     # (B, H, L, E): one query
        k = rng.standard_normal((1, 1, keys, d))                  # (B, H, S, E)
        v = rng.standard_normal((1, 1, keys, 1))                  # (B, H, S, Ev): values do not matter here
        got = {}
        for name, scale in (("", 1.0), ("_scaled", None)):
            with qkv.trace() as tr:
                qkv.scaled_dot_product_attention(q, k, v, scale=scale, backend="reference")
            got["scores" + name] = tr["scores"].array[0, 0, 0]     # q·k, (S,)
            got["entering" + name] = tr["scaled"].array[0, 0, 0]   # what enters the softmax
            got["weights" + name] = tr["weights"].array[0, 0, 0]
        examples.append({"d_k": d, "scores": got["scores"].tolist(), "scaled": got["entering_scaled"].tolist(),
                         "weights": got["weights"].tolist(), "weights_scaled": got["weights_scaled"].tolist()})
    return {"scale": result, "examples": examples, "seed": seed, "samples": result["settings"]["samples"]}


def _json_for_script(data) -> str:
    """JSON that is safe inside ``<script type="application/json">``: no ``<``, ``>`` or ``&`` left."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            raise ValueError("page data: expected finite numbers")
        return x
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=clean)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


_PARTS = ("playground", "model", "example", "generation", "compare", "long", "why")


def render_page(data: dict, *, lang: str | None = None) -> str:
    """The page's HTML for ``{"playground": playground_data(...), "model": model_data(...), "example":
    worked_data(...), "generation": generation_data(...), "why": why_data(), "notices": […]}`` (any of them; each
    value checked against its view's shape, :func:`qkv.viz.page_data.normalize`: a ValueError names the key).

    ``lang``: the language of the page's words (a :mod:`qkv.locales` language; default ``data["lang"]`` or
    English). Its ``page.*`` strings are embedded with the data; the page stays one offline file. A playground
    over :data:`PLAYGROUND_MAX_CELLS` cells is left out with a notice on the page (the tab would crawl);
    PageTooLarge when the page would pass :data:`MAX_PAGE_BYTES`.
    """
    import qkv
    from qkv import locales

    data, lang = normalize(data), lang if lang is not None else (data or {}).get("lang", locales.DEFAULT)
    lang = locales.check_lang(lang)
    title = in_language(data, lang)                                # qkv's own titles in the page's language
    notices = data["notices"]
    playground = data.get("playground")
    if playground and _playground_cells(playground) > PLAYGROUND_MAX_CELLS:
        notices.append(_notice("page.playground_too_big", cells=_playground_cells(playground),
                               limit=PLAYGROUND_MAX_CELLS))
        playground = None
    strings = locales.strings(lang, "page.")
    why = data.get("why")
    if why:
        from qkv.tools import lab

        lab_words = locales.strings(lang, "lab.")
        why = dict(why, paragraph=lab.paragraph("scale", why["scale"], lang),
                   strings={k: lab_words[k] for k in WHY_LAB_KEYS})
    payload = {"digits": DIGITS, "lang": lang, "strings": strings, "notices": notices,
               **{k: data.get(k) for k in _PARTS}, "playground": playground, "why": why, "first": data.get("first")}
    css, js = _asset("page.css"), _asset("page.js")
    for name, text in (("page.css", css), ("page.js", js)):
        if re.search(r"</(script|style)", text, re.IGNORECASE):
            raise RuntimeError(f"{name} must not contain a closing </script> or </style> tag")
    values = {"CSS": css, "JS": js, "DATA": _json_for_script(payload), "TITLE": html.escape(title),
              "VERSION": html.escape(qkv.__version__),
              "SCRIPT_HASH": "sha256-" + base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode()}
    page = _PLACEHOLDER.sub(lambda m: values[m.group(1)], _asset("template.html"))
    size = len(page.encode("utf-8"))
    if size > MAX_PAGE_BYTES:
        raise PageTooLarge(f"the page would be {size / 1e6:.1f} MB, over its limit of {MAX_PAGE_BYTES / 1e6:g} MB")
    return page


def write_page(path, data: dict, *, lang: str | None = None) -> str:
    """Write the page to ``path`` (UTF-8) in ``lang`` (see :func:`render_page`); returns the path. OSError when
    it cannot be written. The write is atomic (a temporary file in the same folder, then renamed): a failure
    leaves no half-written page behind."""
    text = render_page(data, lang=lang)
    with atomic_write(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path
