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
import os
import re
from importlib import resources

import numpy as np

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
    variants = _variants(start, rope, alibi, softcap, sink_logits, heads, L, S,
                         width_q if start == "X" else (len(q[0]) if q else None))
    cross = Xkv is not None or kv_tokens is not None or (start != "X" and S != L)
    return {"title": title or "Attention playground", "start": start, "tokens": _tokens(tokens, L, "tokens"),
            "kv_tokens": _tokens(kv_tokens, S, "kv_tokens") if cross else None,
            "X": Xl, "X_kv": Xkv, "W_Q": wq, "W_K": wk, "W_V": wv, "Q": q, "K": k, "V": v, "scores": sc,
            "d_k": d_k, "W_O": wo, "mask": m, "heads": heads, "causal": bool(causal), "scaling": bool(scaling),
            **variants}


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
    return playground_data(worked.X, worked.W_Q, worked.W_K, worked.W_V, Q=worked.Q, K=worked.K, V=worked.V,
                           scores=worked.scores, d_k=worked.d_k,
                           tokens=tokens if tokens is not None else worked.tokens,
                           X_kv=worked.X_kv, kv_tokens=kv, W_O=worked.W_O if heads > 1 else None,
                           mask=mask, causal=causal, heads=heads, title=worked.title, rope=rope,
                           alibi="auto" if alibi is True else alibi, softcap=getattr(worked, "softcap", None),
                           sink_logits=getattr(worked, "sink_logits", None))


def model_data(text: str, *, model=None, digits: int = 6) -> dict:
    """Attention weights of every layer and head of ``qkv.models.load_bert()`` (or ``model``) for one text."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text: expected a non-empty sentence, got {text!r}")
    if model is None:
        try:
            from qkv.models import load_bert
        except ImportError as exc:
            raise ImportError(f"the model view needs qkv.models and the model extra: pip install 'qkv[model]' "
                              f"({exc})") from None
        model = load_bert()
    out = model.run([text])
    T = int(np.asarray(out.attention_mask)[0].sum())
    att = [np.asarray(a)[0, :, :T, :T] for a in out.attentions]                 # per layer (H, T, T)
    name = getattr(getattr(model, "config", None), "name", "") or type(model).__name__
    return {"name": name, "text": text,
            "tokens": [str(t) for t in out.tokens[0][:T]], "layers": len(att), "heads": int(att[0].shape[0]),
            "attentions": [np.round(a.astype(np.float64), digits).tolist() for a in att],
            "digits": MODEL_DIGITS}


def _json_for_script(data) -> str:
    """JSON that is safe inside ``<script type="application/json">``: no ``<``, ``>`` or ``&`` left."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            raise ValueError("page data: expected finite numbers")
        return x
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=clean)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def render_page(data: dict, *, lang: str | None = None) -> str:
    """The page's HTML for ``{"playground": playground_data(...) or None, "model": model_data(...) or None}``.

    ``lang``: the language of the page's words (a :mod:`qkv.locales` language; default ``data["lang"]`` or
    English). Its ``page.*`` strings are embedded with the data; the page stays one offline file.
    """
    import qkv
    from qkv import locales

    if not isinstance(data, dict) or not (data.get("playground") or data.get("model")):
        raise ValueError("data: expected a dict with 'playground' and/or 'model'")
    lang = locales.check_lang(lang if lang is not None else data.get("lang", locales.DEFAULT))
    payload = {"digits": DIGITS, "playground": data.get("playground"), "model": data.get("model"), "lang": lang,
               "strings": locales.strings(lang, "page.")}
    css, js = _asset("page.css"), _asset("page.js")
    for name, text in (("page.css", css), ("page.js", js)):
        if re.search(r"</(script|style)", text, re.IGNORECASE):
            raise RuntimeError(f"{name} must not contain a closing </script> or </style> tag")
    title = (data.get("playground") or {}).get("title") or "qkv attention"
    values = {"CSS": css, "JS": js, "DATA": _json_for_script(payload), "TITLE": html.escape(title),
              "VERSION": html.escape(qkv.__version__),
              "SCRIPT_HASH": "sha256-" + base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode()}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], _asset("template.html"))


def write_page(path, data: dict, *, lang: str | None = None) -> str:
    """Write the page to ``path`` (UTF-8) in ``lang`` (see :func:`render_page`); returns the path. OSError when
    it cannot be written."""
    path = os.fspath(path)
    text = render_page(data, lang=lang)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return path
