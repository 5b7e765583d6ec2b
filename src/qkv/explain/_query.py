"""The one-query document (see :func:`qkv.explain.render.explain_query`): one function per section.

:func:`build_query_doc` checks its arguments, picks the keys to write out and calls the sections in the order
the calculation runs: RoPE, q and its scores, scaling, bias/soft-capping/score_mod, mask, softmax, dropout and
the weighted sum. Each section reads the query's row of its step (a row-sampled step holds only some rows).
"""
from __future__ import annotations

import math

import numpy as np

from qkv.core.tracing import Step, Trace
from qkv.explain import _variants as var
from qkv.explain._arith import (_dk, _exp_part, _product_line, _ratio_part, _scale_line, _sum_line, mask_formula,
                     softmax_formula)
from qkv.explain.doc import Doc, Section, Table, fmt, fmt_factor
from qkv.explain._layout import SHOW, SMALL, _check_common, _Labels, _local_row, _table, full_shape
from qkv.locales import t


def _lead_index(arr: np.ndarray, head: int, batch: int, what: str) -> tuple:
    lead = arr.shape[:-2]
    for name, v in (("head", head), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if len(lead) == 0:
        if head != 0 or batch != 0:
            raise ValueError(f"head/batch: the trace's {what} has shape {arr.shape} (one head, no batch); expected "
                             f"head=0 and batch=0, got head={head}, batch={batch}")
        return ()
    if len(lead) == 1:
        if batch != 0:
            raise ValueError(f"batch: the trace's {what} has shape {arr.shape} (heads, L, S), no batch; expected 0, "
                             f"got {batch}")
        if not 0 <= head < lead[0]:
            raise ValueError(f"head: expected 0..{lead[0] - 1}, got {head}")
        return (head,)
    nb, nh = int(np.prod(lead[:-1])), lead[-1]
    if not 0 <= head < nh:
        raise ValueError(f"head: expected 0..{nh - 1}, got {head}")
    if not 0 <= batch < nb:
        raise ValueError(f"batch: expected 0..{nb - 1}, got {batch}")
    return tuple(np.unravel_index(batch, lead[:-1])) + (head,)


def _bcast(a, shape):
    return np.broadcast_to(np.asarray(a), shape)


class _Query:
    """One query's document as it is built: the trace, the query's row and slice, its labels, the keys written
    out, and the sections so far (numbered in order)."""

    def __init__(self, trace: Trace, row: int, idx: tuple, lang: str, precision: int, lab: _Labels, doc: Doc):
        self.trace, self.row, self.idx, self.lang, self.p, self.lab, self.doc = (trace, row, idx, lang, precision,
                                                                                 lab, doc)
        self.w_step = trace["weights"]
        self.W = self.w_step.array
        self.S = full_shape(self.w_step)[-1]
        self.qlabel = lab.query(row)
        self.w = np.asarray(self.W[idx])[self.loc(self.w_step)].astype(np.float64)           # (S,)
        self.keys, self.keys_note = self._pick_keys()
        self.n = 0

    def _pick_keys(self):
        """Which keys to write out: all when few, else the largest weights (and a note on the rest)."""
        S, w = self.S, self.w
        if S <= 16:
            return list(range(S)), None
        keys = sorted(np.argsort(-w, kind="stable")[:SMALL].tolist())
        rest = [j for j in range(S) if j not in keys]
        return keys, t("explain.q_keys_more", self.lang, k=len(keys), n=S, rest=len(rest), w=fmt(w[rest].sum(), self.p))

    def loc(self, step: Step) -> int:
        """Where the query's row is in this step's array (a row-sampled step holds only some rows)."""
        return _local_row(step, self.row)

    def sec(self, step, title, formula=None, shape=None) -> Section:
        self.n += 1
        s = Section(step=step, title=f"{t('explain.step', self.lang, n=self.n)} · {title}", formula=formula,
                    shape=shape)
        self.doc.sections.append(s)
        return s

    def key_row_table(self, name: str, vals) -> Table:
        """The query's row of ``vals`` at the keys written out, as a one-row table."""
        return _table(name, vals[self.keys][None, :].astype(np.float64), [self.qlabel],
                      [self.lab.key(j) for j in self.keys], self.lang, self.p)


def _rope_section(q: _Query) -> None:
    rot = q.trace["Q_rot"] if "Q_rot" in q.trace else None
    if rot is None or rot.array.shape[:-2] != q.W.shape[:-2] or rot.operands.get("x") is None:
        return
    E = rot.array.shape[-1]
    s = q.sec("Q_rot", t("explain.q_rope", q.lang, label=q.qlabel), formula=rot.formula, shape=f"({E},)")
    for line in var.rope_note(rot, q.lang, q.p):
        s.text(line)
    half = E // 2
    lines = var.rope_lines(rot, q.idx, q.loc(rot), q.qlabel, q.p, None if half <= SMALL else range(SHOW // 2))
    if half > SMALL:
        lines.append(t("explain.pairs_more", q.lang, n=half))
    s.calc(lines)
    if "K_rot" in q.trace:
        s.text(t("explain.q_rope_keys", q.lang))


def _scores_sections(q: _Query) -> None:
    """The query vector and its scores q · k_j (or the given scores when the trace starts from them)."""
    trace, idx, lang, p, lab, qlabel, S = q.trace, q.idx, q.lang, q.p, q.lab, q.qlabel, q.S
    scores_step = trace["scores"] if "scores" in trace else None
    if scores_step is not None and scores_step.op == "matmul":
        qa = scores_step.operands["a"]
        lead_shape = scores_step.array.shape[:-2]
        qa = _bcast(qa, lead_shape + qa.shape[-2:])
        qv = np.asarray(qa[idx])[q.loc(scores_step)]
        E = qv.shape[-1]
        qname = "Q_rot" if "Q_rot" in trace else "Q_heads" if "Q_heads" in trace else "Q"
        s = q.sec("Q", t("explain.q_vec", lang, name=qname, label=qlabel), shape=f"({E},)")
        s.table(_table("q", qv[None, :].astype(np.float64), [qlabel], [str(k) for k in range(E)], lang, p))
        s = q.sec("scores", t("explain.q_scores", lang), formula="scores[q, j] = q · k_j", shape=f"({S},)")
        arr = np.asarray(scores_step.array[idx])[q.loc(scores_step)]
        lines = []
        for j in q.keys:
            terms = scores_step.terms((*idx, q.loc(scores_step), j))
            lines.append(_product_line(f"q · k_{lab.key(j)}", terms, arr[j], p, lang=lang))
        s.calc(lines)
        if q.keys_note:
            s.text(q.keys_note)
    elif scores_step is not None:
        s = q.sec("scores", t("explain.t_in_scores", lang), shape=f"({S},)")
        s.text(t("explain.q_given", lang))
        arr = np.asarray(_bcast(scores_step.array, full_shape(q.w_step))[idx])[q.loc(scores_step)]
        s.table(_table("scores", arr[None, :].astype(np.float64), [qlabel], [lab.key(j) for j in range(S)], lang, p))


def _scaled_section(q: _Query) -> None:
    if "scaled" not in q.trace:
        return
    lang, p, idx = q.lang, q.p, q.idx
    st = q.trace["scaled"]
    sc = float(st.params.get("scale", float("nan")))
    d_k = st.params.get("d_k")
    s = q.sec("scaled", t("explain.q_scaled", lang), formula=st.formula)
    if st.params.get("is_default") and d_k is not None:
        sq = math.sqrt(float(d_k))
        s.text(t("explain.n_scaled", lang, d=_dk(d_k), sqrt=fmt(sq, p), scale=fmt(sc, p)))
        op = f"/ {fmt(sq, p)}"
    else:
        sq = None
        s.text(t("explain.n_scaled_custom", lang, scale=fmt(sc, p)))
        op = f"× {fmt(sc, p)}"
    src = st.operands.get("scores")
    vals = np.asarray(st.array[idx])[q.loc(st)]
    srow = None if src is None else np.asarray(_bcast(src, st.array.shape)[idx])[q.loc(st)]
    s.calc([f"{q.lab.key(j)}: " + (_scale_line(None, srow[j], sq if op.startswith("/") else None, sc, vals[j], p)
                                   if srow is not None else f"? {op} = {fmt(vals[j], p)}") for j in q.keys])


def _variant_sections(q: _Query) -> None:
    """ALiBi or a bias, soft-capping and a score_mod: a line per key written out, and the row."""
    lang, p, idx, lab = q.lang, q.p, q.idx, q.lab
    for name in ("biased", "capped", "modified"):
        if name not in q.trace or q.trace[name].array.shape != q.W.shape:
            continue
        st = q.trace[name]
        if st.op == "bias":
            slopes = var.slopes_text(st, p)
            s = q.sec(name, t("explain.t_alibi" if slopes else "explain.t_bias", lang), formula=st.formula)
            s.text(t("explain.n_alibi", lang, slopes=slopes) if slopes else t("explain.n_bias", lang))
            if st.operands.get("scaled") is not None:
                s.calc([var.bias_line(st, idx, q.loc(st), j, lab.key(j), p, qi=q.row) for j in q.keys])
        elif st.op == "softcap":
            cap = fmt(st.params.get("cap", float("nan")), p)
            s = q.sec(name, t("explain.t_softcap", lang, cap=cap), formula=st.formula)
            s.text(t("explain.n_softcap", lang, cap=cap))
            if st.operands.get("scores") is not None:
                s.calc([var.softcap_line(st, idx, q.loc(st), j, lab.key(j), p) for j in q.keys])
        else:
            s = q.sec(name, t("explain.t_modified", lang, fn=st.params.get("fn", "score_mod")), formula=st.formula)
        vals = np.asarray(st.array[idx])[q.loc(st)]
        s.table(q.key_row_table(name, vals))


def _mask_section(q: _Query) -> None:
    if "masked" not in q.trace:
        return
    lang, p, idx, lab, qlabel = q.lang, q.p, q.idx, q.lab, q.qlabel
    mk = q.trace["masked"]
    m = mk.operands.get("mask")
    given, boolean, formula = mask_formula(mk, lang)          # naming the scores the mask was applied to
    s = q.sec("masked", t("explain.q_mask", lang), formula=formula)
    vals = np.asarray(mk.array[idx])[q.loc(mk)]
    if boolean:
        mrow = np.asarray(_bcast(m, mk.array.shape)[idx])[q.loc(mk)]
        s.text(t("explain.n_mask", lang))
        source = mk.params.get("source")
        if source is not None:
            s.calc(var.mask_rules(source, lang, p) +
                   [var.mask_row_line(source, mrow, q.row, qlabel, lab.key, lang, lab.k is not None)])
        cols = q.keys
        s.table(Table("mask", [qlabel], [lab.key(j) for j in cols], [[bool(mrow[j]) for j in cols]], "bool"))
    else:
        s.text(t("explain.n_mask_float", lang, input=given))
    s.table(q.key_row_table("masked", vals))


def _softmax_lines(q: _Query, sink, e, total, mx, logits) -> list[str]:
    """The query's softmax written out: the max, the sum (and a sink's term), exp(x − max) → e / sum per key."""
    lang, p, lab, w, S = q.lang, q.p, q.lab, q.w, q.S
    r = q.loc(q.w_step)
    x = np.asarray(logits[q.idx])[r]
    ex = np.asarray(e[q.idx])[r]
    tot = float(np.asarray(total[q.idx])[r, 0])
    m = float(np.asarray(mx[q.idx])[r, 0])
    lines = [f"{t('explain.max', lang)} = {fmt(m, p)}"]
    for j in q.keys:
        if np.isneginf(x[j]):
            lines.append(f"{lab.key(j)}: exp(−∞) = 0 → 0")
        else:
            lines.append(f"{lab.key(j)}: {_exp_part(x[j], m, ex[j], p)} → {_ratio_part(ex[j], tot, w[j], p)}")
    if S <= SMALL:
        lines.insert(1, _sum_line(t('explain.sum', lang), ex, None if sink is None else sink[1], tot, p))
    else:
        plus_sink = "" if sink is None else f" + {fmt(sink[1], p)}"
        lines.insert(1, f"{t('explain.sum', lang)} = Σ ({S}){plus_sink} = {fmt(tot, p)}")
    if sink is not None:
        lines.insert(1, f"{t('explain.sink', lang)}: {_exp_part(sink[0], m, sink[1], p)}")
    return lines


def _softmax_section(q: _Query) -> None:
    lang, w_step = q.lang, q.w_step
    s = q.sec("weights", t("explain.q_softmax", lang), formula=softmax_formula(w_step, q.trace))
    s.text(t("explain.n_softmax", lang))
    sink = var.sink_values(w_step, q.idx, q.loc(w_step))
    if sink is not None:
        s.text(t("explain.n_sinks", lang))
    e, total, mx, logits = (w_step.operands.get(k) for k in ("exp", "sum", "max", "logits"))
    if all(v is not None for v in (e, total, mx, logits)):
        s.calc(_softmax_lines(q, sink, e, total, mx, logits))
    if q.keys_note:
        s.text(q.keys_note)
    s.table(_table("weights", q.w[q.keys][None, :], [q.qlabel], [q.lab.key(j) for j in q.keys], lang, q.p))


def _dropout_section(q: _Query) -> None:
    if "dropout" not in q.trace:
        return
    d = q.trace["dropout"]
    s = q.sec("dropout", t("explain.t_dropout", q.lang), formula=d.formula)
    s.text(t("explain.n_dropout", q.lang, keep=fmt(1 - float(d.params.get("p", 0.0)), q.p)))
    dv = np.asarray(d.array[q.idx])[q.loc(d)]
    s.table(q.key_row_table("dropout", dv))


def _output_section(q: _Query) -> None:
    """The weighted sum: output[q, c] = Σ_j weights[q, j] × V[j, c], column by column."""
    if "output" not in q.trace or q.trace["output"].op != "matmul":
        return
    lang, p, qlabel, S = q.lang, q.p, q.qlabel, q.S
    o = q.trace["output"]
    out = np.asarray(o.array[q.idx])[q.loc(o)]
    Ev = out.shape[-1]
    s = q.sec("output", t("explain.q_out", lang), formula=o.formula, shape=f"({Ev},)")
    s.text(t("explain.n_output", lang))
    lines = []
    cols = range(Ev) if Ev <= SMALL else range(SHOW)
    for c in cols:
        terms = o.terms((*q.idx, q.loc(o), c))
        if S > 16:
            terms_shown = [terms[j] for j in q.keys]
            expr = " + ".join(f"{fmt_factor(a, p)}×{fmt_factor(b, p)}" for a, b in terms_shown)
            lines.append(f"output[{qlabel}, {c}] = {expr} + {t('explain.terms_more', lang, n=S)} = "
                         f"{fmt(out[c], p)}")
        else:
            lines.append(_product_line(f"output[{qlabel}, {c}]", terms, out[c], p, lang=lang))
    if Ev > len(cols):
        lines.append(t("explain.terms_more", lang, n=Ev))
    s.calc(lines)
    s.table(_table("output", out[None, :].astype(np.float64), [qlabel], [str(c) for c in range(Ev)], lang, p))
    if "final_output" in q.trace and "concat" in q.trace:
        s.text(t("explain.q_after", lang))
    elif "concat" in q.trace:
        s.text(t("explain.q_after_concat", lang))


def build_query_doc(trace: Trace, row: int, *, head: int = 0, batch: int = 0, lang: str = "en",
                    precision: int = 4, tokens=None, kv_tokens=None) -> Doc:
    """The document of one query's calculation (see :func:`qkv.explain.render.explain_query`)."""
    tokens, kv_tokens = _check_common(trace, lang, "text", precision, tokens, kv_tokens)
    if "weights" not in trace:
        raise ValueError(f"trace: expected a 'weights' step (the softmax), got steps {trace.names()}")
    w_step = trace["weights"]
    W = w_step.array
    idx = _lead_index(W, head, batch, "weights")
    L = full_shape(w_step)[-2]
    if isinstance(row, bool) or not isinstance(row, (int, np.integer)):
        raise TypeError(f"row: expected an int (the query's 0-based row), got {type(row).__name__}")
    if not 0 <= row < L:
        raise ValueError(f"row: expected 0..{L - 1} (the query rows), got {row}")
    row = int(row)
    lab = _Labels(trace, tokens, kv_tokens)
    where = []
    if len(W.shape) >= 3:
        where.append(t("explain.head", lang, h=head))
    if len(W.shape) >= 4 and int(np.prod(W.shape[:-3])) > 1:
        where.append(t("explain.batch", lang, b=batch))
    doc = Doc(title=t("explain.q_title", lang, label=lab.query(row),
                      where=(" (" + ", ".join(where) + ")") if where else ""), lang=lang)
    doc.intro.append(t("explain.overview", lang))
    q = _Query(trace, row, idx, lang, precision, lab, doc)
    for section in (_rope_section, _scores_sections, _scaled_section, _variant_sections, _mask_section,
                    _softmax_section, _dropout_section, _output_section):
        section(q)
    return doc
