"""The written-out arithmetic of the attention variants' steps, shared by :func:`~qkv.explain.render` and
:func:`~qkv.explain.explain_query`:

- RoPE (``Q_rot``, ``K_rot``): each pair of coordinates turned by ``φ = position × θ_i``, its cos and sin;
- ALiBi (``biased``): ``scaled + m_h·(j − i)``;
- soft-capping (``capped``): ``c·tanh(s / c)``;
- the mask's source (a :class:`qkv.mods.MaskMod`, ``"causal"``, a given matrix): which keys each query may
  see, and why;
- attention sinks in the softmax: the sink's ``exp(s − max)`` in the denominator.

Every value after the last ``=`` is an element of the stage's recorded output; the operands are the ones it
recorded (``x``, ``cos``, ``sin``, ``positions``; ``scaled`` and ``bias``; ``scores``; ``sinks``,
``sink_exp``). What is derived for the reader — the pair frequencies ``θ_i = θ^(−2i/d)``, the angle
``position × θ_i``, ``j − i``, ``s / c`` and ``tanh`` — is formatting arithmetic on recorded parameters.
"""
from __future__ import annotations

import numpy as np

from qkv.locales import t
import math

from qkv.explain.doc import MINUS, fit, fmt, shown


# ----------------------------------------------------------------------------------------------- RoPE
def rope_pairs(style: str, E: int) -> list[tuple[int, int]]:
    """The coordinate pairs RoPE turns: (i, i + E/2) for ``neox``, (2i, 2i + 1) for ``interleaved``."""
    half = E // 2
    if style == "interleaved":
        return [(2 * i, 2 * i + 1) for i in range(half)]
    return [(i, i + half) for i in range(half)]


def rope_thetas(theta: float, E: int) -> np.ndarray:
    """The pair frequencies ``θ_i = θ^(−2i/E)`` (as :func:`qkv.positions.inv_freq` computes them)."""
    return 1.0 / float(theta) ** (np.arange(0, E, 2, dtype=np.float64) / E)


def rope_note(step, lang: str, p: int) -> list[str]:
    """The rule and the frequencies of a rope step."""
    E = step.array.shape[-1]
    style = step.params.get("style", "neox")
    theta = step.params.get("theta")
    out = [t("explain.n_rope", lang, d=E),
           t("explain.n_rope_neox" if style == "neox" else "explain.n_rope_interleaved", lang, half=E // 2)]
    if theta is not None:
        th = rope_thetas(theta, E)
        shown = [f"θ_{i} = {fmt(v, p)}" for i, v in enumerate(th)]
        if len(shown) > 8:
            shown = shown[:4] + ["…", shown[-1]]
        out.append(t("explain.n_rope_theta", lang, theta=fmt(theta, p), d=E, values=", ".join(shown)))
    return out


def rope_lines(step, idx: tuple, i: int, lhs_row: str, p: int, pairs=None) -> list[str]:
    """Row ``i`` of the rope step's slice ``idx``: two lines per pair — the angle with its cos and sin, then
    ``(a·cos φ − b·sin φ, b·cos φ + a·sin φ)`` with the numbers."""
    out_arr = np.asarray(step.array)
    shape = out_arr.shape
    E = shape[-1]
    x = np.broadcast_to(np.asarray(step.operands["x"]), shape)[idx][i]                   # (E,)
    cos = np.broadcast_to(np.asarray(step.operands["cos"]), shape[:-1] + (E // 2,))[idx][i]
    sin = np.broadcast_to(np.asarray(step.operands["sin"]), shape[:-1] + (E // 2,))[idx][i]
    pos = step.operands.get("positions")
    pos = None if pos is None else int(np.broadcast_to(np.asarray(pos), shape[:-1])[idx][i])
    y = out_arr[idx][i]
    theta = step.params.get("theta")
    th = rope_thetas(theta, E) if theta is not None else None
    lines = []
    all_pairs = rope_pairs(step.params.get("style", "neox"), E)
    for k in (range(len(all_pairs)) if pairs is None else pairs):
        a_i, b_i = all_pairs[k]
        c, s = float(cos[k]), float(sin[k])
        head = f"{step.name}[{lhs_row}, ({a_i}, {b_i})]: "
        if pos is not None and th is not None:
            phi = pos * th[k]

            def angle(ln, k=k, phi=phi, c=c, s=s) -> str:
                tt = ln.n(th[k])
                ft = ln.n(phi)
                exact = None if shown(tt) is None else pos * shown(tt)
                f = shown(ft)
                out = f"φ = {pos} × {tt} {ln.rel(exact, phi, at=ln.q)} rad, "
                return (out + f"cos φ {ln.rel(None if f is None else math.cos(f), c)}, "
                        f"sin φ {ln.rel(None if f is None else math.sin(f), s)}")
            lines.append(head + fit(p, angle))
        else:
            lines.append(head + f"cos φ = {fmt(c, p)}, sin φ = {fmt(s, p)}")
        a, b = float(x[a_i]), float(x[b_i])

        def turn(ln, a=a, b=b, c=c, s=s, a_i=a_i, b_i=b_i) -> str:
            at, bt, ct, st = ln.f(a), ln.f(b), ln.f(c), ln.f(s)
            A, B, Cc, Ss = (shown(v) for v in (at, bt, ct, st))
            ok = None not in (A, B, Cc, Ss)
            r1 = ln.rel(A * Cc - B * Ss if ok else None, y[a_i])
            r2 = ln.rel(B * Cc + A * Ss if ok else None, y[b_i])
            sym = "≈" if "≈" in (r1[0], r2[0]) else "="
            return f"  = ({at}×{ct} − {bt}×{st}, {bt}×{ct} + {at}×{st}) {sym} ({r1[2:]}, {r2[2:]})"
        lines.append(fit(p, turn))
    return lines


# ----------------------------------------------------------------------------------------------- ALiBi, softcap
def head_of(idx: tuple) -> int:
    """The head of a slice index (its last lead index; 0 without heads)."""
    return int(idx[-1]) if len(idx) else 0


def slopes_text(step, p: int) -> str | None:
    slopes = step.params.get("slopes")
    if slopes is None:
        return None
    return ", ".join(f"m_{h} = {fmt(m, p)}" for h, m in enumerate(np.asarray(slopes).ravel()))


def bias_line(step, idx: tuple, i: int, j: int, lhs: str, p: int, qi: int | None = None) -> str:
    """``lhs = scaled + m_h×(j − i) = value`` (or ``scaled + bias = value`` for another bias). ``i`` indexes the
    step's array; ``qi`` is the query's true row when that differs (a row-sampled step)."""
    shape = step.array.shape
    s = float(np.broadcast_to(np.asarray(step.operands["scaled"]), shape)[idx][i, j])
    v = float(np.asarray(step.array)[idx][i, j])
    slopes = step.params.get("slopes")
    if slopes is not None:
        m = float(np.asarray(slopes).ravel()[head_of(idx)])
        d = j - (i if qi is None else qi)
        dist = f"({MINUS}{-d})" if d < 0 else str(d)

        def build(ln) -> str:
            st, mt = ln.n(s), ln.f(m)
            exact = None if shown(st) is None or shown(mt) is None else shown(st) + shown(mt) * d
            return f"{lhs} = {st} + {mt}×{dist} {ln.rel(exact, v)}"
        return fit(p, build)
    b = float(np.broadcast_to(np.asarray(step.operands["bias"]), shape)[idx][i, j])

    def build_b(ln) -> str:
        st, bt = ln.n(s), ln.f(b)
        exact = None if shown(st) is None or shown(bt) is None else shown(st) + shown(bt)
        return f"{lhs} = {st} + {bt} {ln.rel(exact, v)}"
    return fit(p, build_b)


def softcap_line(step, idx: tuple, i: int, j: int, lhs: str, p: int) -> str:
    """``lhs = c·tanh(s / c) = c·tanh(s/c) = c×tanh = value``."""
    c = float(step.params.get("cap"))
    s = float(np.broadcast_to(np.asarray(step.operands["scores"]), step.array.shape)[idx][i, j])
    v = float(np.asarray(step.array)[idx][i, j])
    def build(ln) -> str:
        cc, st, rt, tt = ln.n(c), ln.n(s), ln.n(s / c), ln.f(v / c)
        C, S_, R, T_ = (shown(x) for x in (cc, st, rt, tt))
        r1 = ln.rel(None if S_ is None or not C else S_ / C, s / c, at=ln.q)     # intermediate: at q decimals
        r2 = ln.rel(None if R is None else math.tanh(R), v / c, at=ln.q)
        r3 = ln.rel(None if C is None or T_ is None else C * T_, v)
        return (f"{lhs} = {cc}·tanh({st} / {cc}) {r1[0]} {cc}·tanh({rt}) {r2[0]} {cc}×{tt} {r3}")
    return fit(p, build)


# ----------------------------------------------------------------------------------------------- masks
def _leaf_rule(mod, lang: str, p: int) -> str:
    name = getattr(mod, "name", None)
    params = getattr(mod, "params", {}) or {}
    if name == "causal":
        return t("explain.mask_causal", lang)
    if name == "sliding_window":
        w = int(params["window"])
        return t("explain.mask_window", lang, w=w, back=w - 1)
    if name == "prefix_lm":
        return t("explain.mask_prefix", lang, n=int(params["prefix_len"]))
    if name == "sinks":
        return t("explain.mask_sinks", lang, n=int(params["n"]))
    if name == "document":
        ids = np.asarray(params["doc_ids"])
        shown = " ".join(str(int(x)) for x in ids.ravel()[:32]) + (" …" if ids.size > 32 else "")
        return t("explain.mask_document", lang, ids=shown)
    if name == "matrix":
        return t("explain.mask_matrix", lang)
    return t("explain.mask_custom", lang, name=str(name or mod))


def mask_rules(source, lang: str, p: int, depth: int = 0) -> list[str]:
    """Why each key is visible: one line per mask mod of ``source`` (combinations indented)."""
    pad = "  " * depth
    if source is None:
        return []
    if isinstance(source, str):
        if source == "causal":
            return [pad + t("explain.mask_causal", lang)]
        return [pad + t("explain.mask_matrix", lang)]
    name = getattr(source, "name", None)
    children = getattr(source, "children", ())
    if name in ("and_masks", "or_masks") and children:
        head = t("explain.mask_and" if name == "and_masks" else "explain.mask_or", lang)
        out = [pad + head]
        for c in children:
            out += mask_rules(c, lang, p, depth + 1)
        return out
    return [pad + _leaf_rule(source, lang, p)]


def _document_ids(source):
    """The 1-D document ids of a document mask mod inside ``source`` (None if there is none)."""
    if source is None or isinstance(source, str):
        return None
    if getattr(source, "name", None) == "document":
        ids = np.asarray(source.params.get("doc_ids"))
        return ids if ids.ndim == 1 else None
    for c in getattr(source, "children", ()):
        got = _document_ids(c)
        if got is not None:
            return got
    return None


def _ranges(js) -> str:
    out, start, prev = [], None, None
    for j in list(js) + [None]:
        if start is None:
            start = prev = j
        elif j is not None and j == prev + 1:
            prev = j
        else:
            out.append(str(start) if start == prev else f"{start}–{prev}")
            start = prev = j
    return ", ".join(out)


def mask_row_line(source, allowed_row, i: int, qlabel: str, key_label, lang: str, labelled: bool) -> str:
    """``query q (document d) sees keys 0–2 (我, 爱, 吃)`` for one row of a boolean mask (True = may attend)."""
    keys = np.flatnonzero(np.asarray(allowed_row)).tolist()
    if not keys:
        return t("explain.mask_row_none", lang, q=qlabel)
    shown = _ranges(keys)
    if labelled:
        names = [key_label(j) for j in keys[:12]]
        shown += " (" + ", ".join(names) + (", …" if len(keys) > 12 else "") + ")"
    ids = _document_ids(source)
    if ids is not None and i < ids.size:
        return t("explain.mask_row_doc", lang, q=qlabel, doc=int(ids[i]), keys=shown)
    return t("explain.mask_row", lang, q=qlabel, keys=shown)


# ----------------------------------------------------------------------------------------------- sinks
def sink_values(step, idx: tuple, i: int):
    """(sink logit, its exp(sink − max)) of row ``i``, or None without sinks."""
    sinks, sink_exp = step.operands.get("sinks"), step.operands.get("sink_exp")
    if sinks is None or sink_exp is None:
        return None
    shape = step.array.shape[:-1] + (1,)
    return (float(np.broadcast_to(np.asarray(sinks), shape)[idx][i, 0]),
            float(np.broadcast_to(np.asarray(sink_exp), shape)[idx][i, 0]))
