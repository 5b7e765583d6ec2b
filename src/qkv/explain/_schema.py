"""The worked-example schema: :func:`from_dict` validates a parsed file (a mapping) into a :class:`Worked`."""
from __future__ import annotations

import numbers

from qkv.explain._claims import _claims
from qkv.explain._fields import (visible, _describe, _int_list, _is_number, _labels, _lengths_to_ids, _mask, _matrix, _nonneg_int,
                      _number_list, _scalar)
from qkv.explain._numbers import WorkedExampleError, _YamlBool, text_of
from qkv.explain._worked import Worked

#: The keys of the attention variants (RoPE, ALiBi, soft-capping, mask mods, sinks); see :func:`from_dict`.
VARIANT_KEYS = ("rope", "alibi", "softcap", "window", "prefix", "documents", "sinks", "sink_logits")
_KNOWN_KEYS = ("title", "description", "tokens", "kv_tokens", "X", "X_kv", "W_Q", "W_K", "W_V", "W_O", "Q",
               "K", "V", "scores", "d_k", "mask", "heads", "claims", "tolerance") + VARIANT_KEYS
_ROPE_KEYS = ("theta", "style", "positions", "kv_positions")
_ROPE_STYLES = ("neox", "interleaved")


def from_dict(doc, *, name: str | None = None, where: str | None = None) -> Worked:
    """Validate a parsed worked example (a mapping as in the file format) into a :class:`Worked`."""
    where = where or name or "worked example"
    doc = _known_keys(doc, where)
    w = Worked(name=name)
    _texts(doc, w, where)
    has_x, has_qk, starts = _starting_point(doc, where)
    if has_x:
        L, S, E, Ev = _from_x(doc, w, where)
    elif has_qk:
        L, S, E, Ev = _from_qk(doc, w, where)
    else:
        L, S, E, Ev = _from_scores(doc, w, where)
    for key in ("X_kv", "W_Q", "W_K", "W_V"):
        if not has_x and doc.get(key) is not None:
            raise WorkedExampleError(f"{where}: {key}: only used with X; this file starts from {starts[0]}")
    _heads(doc, w, has_x, where)
    _d_k_and_tolerance(doc, w, has_x, has_qk, where)
    _tokens(doc, w, has_x, L, S, where)
    w.mask = _mask(doc.get("mask"), L, S, where)
    _variants(doc, w, L, S, E, where)
    w.claims = _claims(doc.get("claims"), w, _claim_shapes(w, has_x, has_qk, L, S, E, Ev), where)
    return w


def _known_keys(doc, where: str) -> dict:
    """The document as a mapping of str keys, each one the format knows."""
    if not isinstance(doc, dict):
        raise WorkedExampleError(f"{where}: expected a mapping of keys (title, tokens, X, W_Q, ..., claims), "
                                 f"found {_describe(doc)}")
    doc = {str(k): v for k, v in doc.items()}
    unknown = [k for k in doc if k not in _KNOWN_KEYS]
    if unknown:
        raise WorkedExampleError(f"{where}: unknown key {unknown[0]!r}; expected some of {', '.join(_KNOWN_KEYS)}")
    return doc


def _texts(doc: dict, w: Worked, where: str) -> None:
    """``title`` and ``description`` into ``w``."""
    for key in ("title", "description"):
        v = doc.get(key)
        if v is not None and (isinstance(v, (dict, list, tuple))):
            raise WorkedExampleError(f"{where}: {key}: expected text, found {_describe(v)}")
        setattr(w, key, None if v is None else visible(str(text_of(v) if _is_number(v) else v)))


def _starting_point(doc: dict, where: str) -> tuple[bool, bool, list[str]]:
    """(has X, has Q/K, the starting points given): exactly one of X, Q/K and scores."""
    for key in ("X", "X_kv", "W_Q", "W_K", "W_V", "W_O", "Q", "K", "V", "scores"):
        if key in doc and doc[key] is None:
            raise WorkedExampleError(f"{where}: {key}: expected a matrix (a list of rows), found nothing (null)")
    has_x = doc.get("X") is not None
    has_qk = doc.get("Q") is not None or doc.get("K") is not None
    has_scores = doc.get("scores") is not None
    starts = [s for s, f in (("X", has_x), ("Q/K", has_qk), ("scores", has_scores)) if f]
    if not starts:
        raise WorkedExampleError(f"{where}: no starting point; expected X (with W_Q, W_K, W_V), or Q and K, or "
                                 "scores")
    if len(starts) > 1:
        raise WorkedExampleError(f"{where}: expected one starting point, found {' and '.join(starts)} (claim later "
                                 "steps under claims:)")
    return has_x, has_qk, starts


def _from_x(doc: dict, w: Worked, where: str) -> tuple:
    """X (and X_kv) with W_Q, W_K, W_V into ``w``; (L, S, E, Ev)."""
    w.X = _matrix(doc["X"], "X", where)
    if doc.get("X_kv") is not None:
        w.X_kv = _matrix(doc["X_kv"], "X_kv", where)
    D = w.X.shape[1]
    Dkv = D if w.X_kv is None else w.X_kv.shape[1]
    for key, rows in (("W_Q", D), ("W_K", Dkv), ("W_V", Dkv)):
        if doc.get(key) is None:
            raise WorkedExampleError(f"{where}: {key}: missing; X needs W_Q, W_K and W_V")
        m = _matrix(doc[key], key, where)
        if m.shape[0] != rows:
            src = "X" if key == "W_Q" or w.X_kv is None else "X_kv"
            raise WorkedExampleError(f"{where}: {key}: expected {rows} rows (the width of {src}), found "
                                     f"{m.shape[0]}")
        setattr(w, key, m)
    if w.W_K.shape[1] != w.W_Q.shape[1]:
        raise WorkedExampleError(f"{where}: W_K: expected {w.W_Q.shape[1]} columns (as W_Q: queries and keys "
                                 f"share a width), found {w.W_K.shape[1]}")
    for key in ("V",):
        if doc.get(key) is not None:
            raise WorkedExampleError(f"{where}: V: not allowed with X (V = X·W_V); claim it under claims:")
    L, S = w.X.shape[0], (w.X if w.X_kv is None else w.X_kv).shape[0]
    E, Ev = w.W_Q.shape[1], w.W_V.shape[1]
    return L, S, E, Ev


def _from_qk(doc: dict, w: Worked, where: str) -> tuple:
    """Q and K (and V) into ``w``; (L, S, E, Ev)."""
    for key in ("Q", "K"):
        if doc.get(key) is None:
            raise WorkedExampleError(f"{where}: {key}: missing; a file that starts from Q and K needs both")
        setattr(w, key, _matrix(doc[key], key, where))
    if w.K.shape[1] != w.Q.shape[1]:
        raise WorkedExampleError(f"{where}: K: expected {w.Q.shape[1]} columns (the width of Q), found "
                                 f"{w.K.shape[1]}")
    L, S, E = w.Q.shape[0], w.K.shape[0], w.Q.shape[1]
    if doc.get("V") is not None:
        w.V = _matrix(doc["V"], "V", where, allow_vector="column")
        if w.V.shape[0] != S:
            raise WorkedExampleError(f"{where}: V: expected {S} rows (one per key), found {w.V.shape[0]}")
    Ev = None if w.V is None else w.V.shape[1]
    return L, S, E, Ev


def _from_scores(doc: dict, w: Worked, where: str) -> tuple:
    """scores (and V) into ``w``; (L, S, None, Ev)."""
    w.scores = _matrix(doc["scores"], "scores", where, allow_vector="row")
    L, S = w.scores.shape
    E = None
    if doc.get("V") is not None:
        w.V = _matrix(doc["V"], "V", where, allow_vector="column")
        if w.V.shape[0] != S:
            raise WorkedExampleError(f"{where}: V: expected {S} rows (one per key, the columns of scores), "
                                     f"found {w.V.shape[0]}")
    Ev = None if w.V is None else w.V.shape[1]
    return L, S, E, Ev


def _heads(doc: dict, w: Worked, has_x: bool, where: str) -> None:
    """``heads`` and ``W_O`` into ``w``, checked against the projections."""
    if doc.get("heads") is not None:
        h = doc["heads"]
        if not isinstance(h, numbers.Integral) or isinstance(h, bool) or isinstance(h, _YamlBool) or h < 1:
            raise WorkedExampleError(f"{where}: heads: expected a positive integer, found {_describe(h)}")
        w.heads = int(h)
    if doc.get("W_O") is not None:
        w.W_O = _matrix(doc["W_O"], "W_O", where)
    if w.heads > 1 or w.W_O is not None:
        if not has_x:
            raise WorkedExampleError(f"{where}: heads: several heads and W_O need X with W_Q, W_K, W_V")
        err = _heads_problem(w.W_Q, w.W_K, w.W_V, w.W_O, w.heads)
        if err:
            raise WorkedExampleError(f"{where}: {err}")


def _d_k_and_tolerance(doc: dict, w: Worked, has_x: bool, has_qk: bool, where: str) -> None:
    """``d_k`` (required from scores) and ``tolerance`` into ``w``."""
    if doc.get("d_k") is not None:
        w.d_k = _scalar(doc["d_k"], "d_k", where)
        if w.heads > 1 and float(w.d_k) != w.W_Q.shape[1] // w.heads:
            raise WorkedExampleError(f"{where}: d_k: with {w.heads} heads it is the head width "
                                     f"{w.W_Q.shape[1] // w.heads}, found {text_of(w.d_k)}")
    elif not has_x and not has_qk:
        raise WorkedExampleError(f"{where}: d_k: missing; a file that starts from scores needs d_k (the d in √d_k)")
    if doc.get("tolerance") is not None:
        w.tolerance = float(_scalar(doc["tolerance"], "tolerance", where, positive=False))
        if w.tolerance < 0:
            raise WorkedExampleError(f"{where}: tolerance: expected a number ≥ 0, found {w.tolerance}")


def _tokens(doc: dict, w: Worked, has_x: bool, L: int, S: int, where: str) -> None:
    """The labels: ``tokens`` (``#0``, ``#1``, ... when not given), ``kv_tokens`` in cross-attention."""
    if doc.get("tokens") is not None:
        w.tokens = _labels(doc["tokens"], "tokens", L, "one per query row", where)
        w.tokens_given = True
    else:
        w.tokens = [f"#{i}" for i in range(L)]
    cross = (has_x and w.X_kv is not None) or (not has_x and S != L)
    if doc.get("kv_tokens") is not None:
        w.kv_tokens = _labels(doc["kv_tokens"], "kv_tokens", S, "one per key/value row", where)
        w.kv_tokens_given = True
    elif cross:
        w.kv_tokens = [f"#{j}" for j in range(S)]


def _claim_shapes(w: Worked, has_x: bool, has_qk: bool, L: int, S: int, E, Ev) -> dict[str, tuple[int, int]]:
    """The shape of every step this example may claim numbers for."""
    shapes: dict[str, tuple[int, int]] = {}
    if has_x:
        if w.heads == 1:
            shapes.update(Q=(L, E), K=(S, E), V=(S, Ev), scores=(L, S), scaled=(L, S), weights=(L, S),
                          output=(L, Ev))
        else:
            shapes.update(Q=(L, E), K=(S, E), V=(S, Ev))
    elif has_qk:
        shapes.update(Q=(L, E), K=(S, E), scores=(L, S), scaled=(L, S), weights=(L, S))
        if w.V is not None:
            shapes.update(V=(S, Ev), output=(L, Ev))
    else:
        shapes.update(scores=(L, S), scaled=(L, S), weights=(L, S))
        if w.V is not None:
            shapes.update(V=(S, Ev), output=(L, Ev))
    if w.heads == 1:
        if w.rope is not None:
            shapes.update(Q_rot=(L, E), K_rot=(S, E))
        if w.alibi is not None:
            shapes.update(biased=(L, S))
        if w.softcap is not None:
            shapes.update(capped=(L, S))
    return shapes


def _variants(doc: dict, w: Worked, L: int, S: int, E: int | None, where: str) -> None:
    """Validate the variant keys (rope, alibi, softcap, window, prefix, documents, sinks, sink_logits) into
    ``w``; each error names the key, expected vs found."""
    H = w.heads
    if doc.get("rope") is not None:
        r = doc["rope"]
        if isinstance(r, _YamlBool) or isinstance(r, bool):
            r = {} if (r.value if isinstance(r, _YamlBool) else r) else None
        if r is not None:
            if not isinstance(r, dict):
                raise WorkedExampleError(f"{where}: rope: expected a mapping {{theta: 10000, style: neox}} (or "
                                         f"true), found {_describe(r)}")
            r = {str(k): v for k, v in r.items()}
            bad = [k for k in r if k not in _ROPE_KEYS]
            if bad:
                raise WorkedExampleError(f"{where}: rope: unknown key {bad[0]!r}; expected some of "
                                         f"{', '.join(_ROPE_KEYS)}")
            if w.start == "scores":
                raise WorkedExampleError(f"{where}: rope: RoPE rotates Q and K; this file starts from scores "
                                         "(give X with W_Q, W_K, W_V, or Q and K)")
            width = E // H
            if width % 2:
                raise WorkedExampleError(f"{where}: rope: RoPE rotates pairs of coordinates; expected an even "
                                         f"{'head ' if H > 1 else ''}width of Q and K, found {width}")
            theta = r.get("theta", 10000.0)
            theta = float(_scalar(theta, "rope.theta", where)) if theta is not None else 10000.0
            style = r.get("style", "neox")
            if not isinstance(style, str) or isinstance(style, _YamlBool) or style not in _ROPE_STYLES:
                raise WorkedExampleError(f"{where}: rope.style: expected one of {', '.join(_ROPE_STYLES)}, found "
                                         f"{_describe(style)}")
            w.rope = {"theta": theta, "style": str(style)}
            if r.get("positions") is not None:
                w.positions = _int_list(r["positions"], "rope.positions", L, "one per query row", where)
            if r.get("kv_positions") is not None:
                if not w.is_cross:
                    raise WorkedExampleError(f"{where}: rope.kv_positions: only with cross-attention (in "
                                             "self-attention the keys are at the queries' positions)")
                w.kv_positions = _int_list(r["kv_positions"], "rope.kv_positions", S, "one per key row", where)
    if doc.get("alibi") is not None:
        a = doc["alibi"]
        if isinstance(a, (_YamlBool, bool)):
            w.alibi = True if (a.value if isinstance(a, _YamlBool) else a) else None
        elif isinstance(a, (list, tuple)) or (_is_number(a) and H == 1):
            w.alibi = _number_list(a, "alibi", H, "one slope per head", where)
        else:
            raise WorkedExampleError(f"{where}: alibi: expected true (slopes from the head count) or a list of "
                                     f"{H} slopes (one per head), found {_describe(a)}")
    if doc.get("softcap") is not None:
        w.softcap = float(_scalar(doc["softcap"], "softcap", where))
    if doc.get("window") is not None:
        w.window = _nonneg_int(doc["window"], "window", where)
    if doc.get("prefix") is not None:
        w.prefix = _nonneg_int(doc["prefix"], "prefix", where)
    if doc.get("sinks") is not None:
        w.sinks = _nonneg_int(doc["sinks"], "sinks", where)
    if doc.get("documents") is not None:
        d = doc["documents"]
        if L != S or w.is_cross:
            raise WorkedExampleError(f"{where}: documents: packed documents need self-attention (queries and "
                                     f"keys at the same positions); found {L} queries and {S} keys")
        if isinstance(d, dict):
            d = {str(k): v for k, v in d.items()}
            if set(d) == {"ids"}:
                w.documents = _int_list(d["ids"], "documents.ids", S, "the document of each position", where)
            elif set(d) == {"lengths"}:
                w.documents = _lengths_to_ids(d["lengths"], "documents.lengths", S, where)
            else:
                raise WorkedExampleError(f"{where}: documents: expected a list of lengths, {{lengths: [...]}} or "
                                         f"{{ids: [...]}}, found the keys {sorted(d)}")
        else:
            w.documents = _lengths_to_ids(d, "documents", S, where)
    if doc.get("sink_logits") is not None:
        w.sink_logits = _number_list(doc["sink_logits"], "sink_logits", H, "one per head", where)


def _heads_problem(W_Q, W_K, W_V, W_O, heads: int) -> str | None:
    """Why these projections cannot be split into ``heads`` heads (None when they can)."""
    F, Fv = W_Q.shape[1], W_V.shape[1]
    if F % heads:
        return (f"heads: {heads} heads need a projection width divisible by {heads}; W_Q has {F} columns "
                f"(head width = columns / heads)")
    if Fv % heads:
        return f"heads: {heads} heads need W_V's width divisible by {heads}; W_V has {Fv} columns"
    if W_O is not None and W_O.shape[0] != Fv:
        return (f"W_O: expected {Fv} rows (the width of the concatenated heads), found {W_O.shape[0]}×"
                f"{W_O.shape[1]}")
    return None
