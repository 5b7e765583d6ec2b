"""The sections of the whole-trace document: one per recorded step (see :func:`qkv.explain.render.build_doc`)."""
from __future__ import annotations

import math

import numpy as np

from qkv.core.tracing import Step, Trace
from qkv.explain import _variants as var
from qkv.explain._arith import (_dk, _exp_part, _product_line, _ratio_part, _scale_line, _sum_line, mask_formula,
                     softmax_formula)
from qkv.explain.doc import Section, Table, fmt
from qkv.explain._layout import (KEYS_AS_COLS, MAX_CALC, SHOW, SMALL, _Labels, _limited_slices, _operand_shape, _shape,
                      _slices, _step_shape, _table, _true_row, full_shape, held_rows, shown_rows)
from qkv.locales import t


class _Builder:
    def __init__(self, trace: Trace, lang: str, precision: int, labels: _Labels):
        self.trace, self.lang, self.p, self.lab = trace, lang, precision, labels
        self.n = 0

    def section(self, step: Step, title: str, shape: str | None = None, formula: str | None = None) -> Section:
        self.n += 1
        return Section(step=step.name, title=f"{t('explain.step', self.lang, n=self.n)} · {title}",
                       formula=formula if formula is not None else step.formula,
                       shape=shape if shape is not None else _step_shape(step))

    def row_labels(self, step: Step, name: str | None = None) -> list[str]:
        """Labels of the rows the step's array holds (all, or a row-sampled step's)."""
        labels = self.lab.rows(name or step.name, full_shape(step)[-2])
        ids = held_rows(step)
        return labels if ids is None else [labels[i] for i in ids]

    def table(self, step: Step, name: str, mat, idx, kind: str = "num", row_name: str | None = None,
              col_name: str | None = None) -> Table:
        """The table of one 2-D slice ``mat`` (= the step's array at ``idx``, or a same-shaped operand)."""
        ids = held_rows(step)
        summary = None
        if ids is not None and kind == "num" and step.params.get("stats") is not None:
            summary = step.params["stats"].get(tuple(int(i) for i in idx))
        return _table(name, mat, self.row_labels(step, row_name), self.lab.cols(col_name or step.name, mat.shape[1]),
                      self.lang, self.p, kind, row_ids=ids, n_rows=full_shape(step)[-2], summary=summary,
                      dtype=np.asarray(step.array).dtype)

    def result_tables(self, sec: Section, step: Step, name: str | None = None, kind: str = "num"):
        slices, more = _limited_slices(step, self.trace, self.lang)
        for label, idx in slices:
            mat = np.asarray(step.array[idx])
            tb_name = (name or step.name) + (f" [{label}]" if label else "")
            sec.table(self.table(step, tb_name, mat.astype(bool) if kind == "bool" else mat.astype(np.float64), idx,
                                 kind))
        if more:
            sec.text(more)

    # -- inputs
    def input(self, step: Step) -> Section:
        key = {"X": "explain.t_X", "X_kv": "explain.t_X_kv", "Q": "explain.t_in_Q", "K": "explain.t_in_K",
               "V": "explain.t_in_V", "scores": "explain.t_in_scores"}.get(step.name)
        title = t(key, self.lang) if key else t("explain.t_in_other", self.lang, name=step.name)
        sec = self.section(step, title, formula="")
        sec.formula = None
        self.result_tables(sec, step)
        return sec

    # -- matrix products
    def matmul(self, step: Step) -> Section:
        b = step.operands["b"]
        name = step.name
        bias = step.operands.get("bias")
        if name == "scores":
            title = t("explain.t_scores", self.lang)
            shape = f"{_operand_shape(step, 'a')} · {_operand_shape(step, 'b')}ᵀ → {_step_shape(step)}"
        elif name == "output":
            title = t("explain.t_output", self.lang)
            shape = f"{_operand_shape(step, 'a')} · {_operand_shape(step, 'b')} → {_step_shape(step)}"
        else:
            key = {"Q": "explain.t_Q", "K": "explain.t_K", "V": "explain.t_V",
                   "final_output": "explain.t_final_output"}.get(name, "explain.t_matmul")
            title = t(key, self.lang, formula=step.formula)
            shape = f"{_operand_shape(step, 'a')} · {_operand_shape(step, 'b')} → {_step_shape(step)}"
        sec = self.section(step, title, shape=shape)
        a_name = step.params.get("a_name", "A")
        b_name = step.params.get("b_name", "B")
        if name == "scores":
            sec.text(t("explain.n_scores", self.lang))
        elif name == "output":
            sec.text(t("explain.n_output", self.lang))
        else:
            if b.ndim == 2:                              # the weight matrix, shown once
                sec.table(_table(b_name, np.asarray(b, dtype=np.float64), [str(i) for i in range(b.shape[0])],
                                 [str(j) for j in range(b.shape[1])], self.lang, self.p, dtype=np.asarray(b).dtype))
                if bias is not None:
                    bv = np.asarray(bias, dtype=np.float64)[None, :]
                    sec.table(_table(f"b_{b_name[2:]}", bv, ["b"], [str(j) for j in range(bv.shape[1])],
                                     self.lang, self.p))
            sec.text(t("explain.n_proj", self.lang, a=a_name, b=b_name if name != "scores" else "Kᵀ"))
        slices, more = _limited_slices(step, self.trace, self.lang)
        for label, idx in slices:
            mat = np.asarray(step.array[idx])
            lines, cells = self._cells(step, mat)
            for i, j in cells:
                terms = step.terms((*idx, i, j))
                lhs = self._element_name(step, i, j)
                bv = None if bias is None else float(np.asarray(bias)[j])
                lines.append(((label + ": ") if label else "") + _product_line(lhs, terms, mat[i, j], self.p, bv,
                                                                                      self.lang))
            sec.calc(lines)
        if more:
            sec.text(more)
        self.result_tables(sec, step)
        return sec

    def _cells(self, step: Step, mat) -> tuple[list[str], list[tuple[int, int]]]:
        """The (local row, column) cells whose arithmetic is written out: every one of a small slice, else the
        first (with a line saying so). Never a list of all cells of a large one."""
        R, C = full_shape(step)[-2], mat.shape[-1]
        if R * C > MAX_CALC or mat.shape[0] != R:
            return [t("explain.one_element", self.lang, n=R * C)], [(0, 0)]
        return [], [(i, j) for i in range(R) for j in range(C)]

    def _element_name(self, step: Step, i: int, j: int) -> str:
        """The name of element (i, j) of the step's array (i a local row: a row-sampled step's true row is used)."""
        i = _true_row(step, i)
        if step.name in KEYS_AS_COLS:
            return f"{step.name}[{self.lab.query(i)}, {self.lab.key(j)}]"
        return f"{step.name}[{self.lab.rows(step.name, i + 1)[i]}, {j}]"

    # -- scale
    def scale(self, step: Step) -> Section:
        sc = float(step.params.get("scale", float("nan")))
        d_k = step.params.get("d_k")
        default = bool(step.params.get("is_default"))
        if default and d_k is not None:
            sqrt = math.sqrt(float(d_k))
            sec = self.section(step, t("explain.t_scaled", self.lang))
            sec.text(t("explain.n_scaled", self.lang, d=_dk(d_k), sqrt=fmt(sqrt, self.p), scale=fmt(sc, self.p)))
        else:
            sqrt = None
            sec = self.section(step, t("explain.t_scaled_custom", self.lang, scale=fmt(sc, self.p)))
            sec.text(t("explain.n_scaled_custom", self.lang, scale=fmt(sc, self.p)))
        src = step.operands.get("scores")
        slices, more = _limited_slices(step, self.trace, self.lang)
        for label, idx in slices:
            mat = np.asarray(step.array[idx])
            lines, cells = self._cells(step, mat)
            for i, j in cells:
                s = float(np.asarray(src[idx])[i, j]) if src is not None else float("nan")
                lines.append(((label + ": ") if label else "") +
                             _scale_line(self._element_name(step, i, j), s, sqrt, sc, mat[i, j], self.p))
            sec.calc(lines)
        if more:
            sec.text(more)
        self.result_tables(sec, step)
        return sec

    # -- mask
    def mask(self, step: Step) -> Section:
        m = step.operands.get("mask")
        given, boolean, formula = mask_formula(step, self.lang)   # naming the scores the mask was applied to
        sec = self.section(step, t("explain.t_masked", self.lang), formula=formula)
        if boolean:
            sec.text(t("explain.n_mask", self.lang))
            full = np.broadcast_to(np.asarray(m), step.array.shape)
            slices, more = _limited_slices(step, self.trace, self.lang)
            first = full[slices[0][1]]
            same = all(np.array_equal(full[idx], first) for _, idx in _slices(step, self.trace, self.lang))
            source = step.params.get("source")
            if source is not None:                       # which keys each query may see, and why
                sec.text(t("explain.n_mask_why", self.lang))
                lines = var.mask_rules(source, self.lang, self.p)
                if same:
                    prev = None
                    for i in shown_rows(step):
                        qi = _true_row(step, i)
                        if prev is not None and qi != prev + 1:
                            lines.append("…")
                        lines.append(var.mask_row_line(source, first[i], qi, self.lab.query(qi), self.lab.key,
                                                       self.lang, self.lab.k is not None))
                        prev = qi
                    if prev is not None and prev < full_shape(step)[-2] - 1:
                        lines.append("…")
                sec.calc(lines)
            for label, idx in (slices[:1] if same else slices):
                sec.table(self.table(step, "mask" + (f" [{label}]" if label and not same else ""), full[idx], idx,
                                     "bool", row_name="scores", col_name="scores"))
        else:
            sec.text(t("explain.n_mask_float", self.lang, input=given))
        self.result_tables(sec, step)
        return sec

    # -- softmax
    def softmax(self, step: Step) -> Section:
        sec = self.section(step, t("explain.t_weights", self.lang), formula=softmax_formula(step, self.trace))
        sec.text(t("explain.n_softmax", self.lang))
        if step.operands.get("sinks") is not None:
            sec.text(t("explain.n_sinks", self.lang))
        e, total, mx, logits = (step.operands.get(k) for k in ("exp", "sum", "max", "logits"))
        slices, more = _limited_slices(step, self.trace, self.lang)
        for label, idx in slices:
            w = np.asarray(step.array[idx])
            R, C = full_shape(step)[-2], w.shape[-1]
            rows = range(R) if (R <= SMALL and C <= SMALL and w.shape[0] == R) else range(1)
            lines = []
            if e is not None and total is not None and mx is not None and logits is not None:
                for i in rows:
                    lines += self._softmax_row(label, idx, i, w, e, total, mx, logits, step)
            if len(rows) < R:
                lines.append(t("explain.one_element", self.lang, n=R))
            sec.calc(lines)
        if more:
            sec.text(more)
        self.result_tables(sec, step)
        return sec

    def _softmax_row(self, label, idx, i, w, e, total, mx, logits, step=None) -> list[str]:
        p = self.p
        x = np.asarray(logits[idx])[i]
        ex = np.asarray(e[idx])[i]
        tot = float(np.asarray(total[idx])[i, 0])
        m = float(np.asarray(mx[idx])[i, 0])
        C = len(x)
        pre = (label + ": ") if label else ""
        qlabel = self.lab.query(i if step is None else _true_row(step, i))
        lines = [f"{pre}{t('explain.row', self.lang, label=qlabel)}: {t('explain.max', self.lang)} = {fmt(m, p)}"]
        show = range(C) if C <= SMALL else range(SHOW)
        parts = []
        for j in show:
            parts.append(_exp_part(x[j], m, ex[j], p))
        lines.append("  " + ";  ".join(parts) + ("; …" if C > len(show) else ""))
        sink = None if step is None else var.sink_values(step, idx, i)
        if sink is not None:
            lines.append(f"  {t('explain.sink', self.lang)}: {_exp_part(sink[0], m, sink[1], p)}")
        if C <= SMALL:
            lines.append("  " + _sum_line(t('explain.sum', self.lang), ex, None if sink is None else sink[1], tot, p))
        else:
            plus_sink = "" if sink is None else f" + {fmt(sink[1], p)}"
            lines.append(f"  {t('explain.sum', self.lang)} = Σ ({C}){plus_sink} = {fmt(tot, p)}")
        lines.append("  " + "  ".join(
            f"{self.lab.key(j)}: {_ratio_part(ex[j], tot, w[i, j], p)}" for j in show)
            + ("  …" if C > len(show) else ""))
        return lines

    # -- dropout
    def dropout(self, step: Step) -> Section:
        sec = self.section(step, t("explain.t_dropout", self.lang))
        pr = float(step.params.get("p", 0.0))
        sec.text(t("explain.n_dropout", self.lang, keep=fmt(1 - pr, self.p)))
        self.result_tables(sec, step)
        return sec

    # -- reshapes
    def split(self, step: Step) -> Section:
        src = step.name[:-len("_heads")]
        x = step.operands.get("x")
        sec = self.section(step, t("explain.t_heads", self.lang, name=src))
        sec.text(t("explain.n_split", self.lang, src=src, src_shape=_shape(x) if x is not None else "?", name=step.name,
                   shape=_shape(step.array)))
        self.result_tables(sec, step)
        return sec

    def repeat(self, step: Step) -> Section:
        x = step.operands.get("x")
        sec = self.section(step, t("explain.t_repeated", self.lang, name=step.name))
        sec.text(t("explain.n_repeat", self.lang, n=step.params.get("n_rep", "?"),
                   hk=(np.shape(x)[-3] if x is not None and np.ndim(x) >= 3 else "?")))
        return sec

    def concat(self, step: Step) -> Section:
        x = step.operands.get("x")
        sec = self.section(step, t("explain.t_concat", self.lang))
        sec.text(t("explain.n_concat", self.lang, src_shape=_shape(x) if x is not None else "?", shape=_shape(step.array)))
        self.result_tables(sec, step)
        return sec

    # -- RoPE
    def rope(self, step: Step) -> Section:
        src = step.name.split("_")[0]
        theta = step.params.get("theta")
        sec = self.section(step, t("explain.t_rope", self.lang, name=step.name, src=src,
                                   style=step.params.get("style", "neox"),
                                   theta=fmt(theta, self.p) if theta is not None else "?"))
        for line in var.rope_note(step, self.lang, self.p):
            sec.text(line)
        if all(step.operands.get(k) is not None for k in ("x", "cos", "sin")):
            slices, more = _limited_slices(step, self.trace, self.lang)
            half = step.array.shape[-1] // 2
            for label, idx in slices:
                R = step.array.shape[-2]
                lines = []
                if R * half > MAX_CALC:
                    lines.append(t("explain.one_element", self.lang, n=R * half))
                    rows, pairs = [0], [0]
                else:
                    rows, pairs = range(R), None
                for i in rows:
                    rl = self.lab.rows(step.name, R)[i]
                    lines += [((label + ": ") if label else "") + ln
                              for ln in var.rope_lines(step, idx, i, rl, self.p, pairs)]
                sec.calc(lines)
            if more:
                sec.text(more)
        self.result_tables(sec, step)
        return sec

    # -- ALiBi and soft-capping: one line per score
    def _elementwise(self, sec: Section, step: Step, line) -> None:
        slices, more = _limited_slices(step, self.trace, self.lang)
        for label, idx in slices:
            lines, cells = self._cells(step, np.asarray(step.array[idx]))
            for i, j in cells:
                lines.append(((label + ": ") if label else "") + line(idx, i, j, self._element_name(step, i, j)))
            sec.calc(lines)
        if more:
            sec.text(more)

    def bias(self, step: Step) -> Section:
        slopes = var.slopes_text(step, self.p)
        if slopes is not None:
            sec = self.section(step, t("explain.t_alibi", self.lang))
            sec.text(t("explain.n_alibi", self.lang, slopes=slopes))
        else:
            sec = self.section(step, t("explain.t_bias", self.lang))
            sec.text(t("explain.n_bias", self.lang))
        if step.operands.get("scaled") is not None:
            self._elementwise(sec, step, lambda idx, i, j, lhs: var.bias_line(step, idx, i, j, lhs, self.p,
                                                                              qi=_true_row(step, i)))
        self.result_tables(sec, step)
        return sec

    def softcap(self, step: Step) -> Section:
        cap = fmt(step.params.get("cap", float("nan")), self.p)
        sec = self.section(step, t("explain.t_softcap", self.lang, cap=cap))
        sec.text(t("explain.n_softcap", self.lang, cap=cap))
        if step.operands.get("scores") is not None:
            self._elementwise(sec, step, lambda idx, i, j, lhs: var.softcap_line(step, idx, i, j, lhs, self.p))
        self.result_tables(sec, step)
        return sec

    def step(self, step: Step) -> Section | None:
        if step.op == "input":
            return self.input(step)
        if step.op == "matmul":
            return self.matmul(step)
        if step.op == "scale":
            return self.scale(step)
        if step.op == "mask":
            return self.mask(step)
        if step.op == "softmax":
            return self.softmax(step)
        if step.op == "dropout":
            return self.dropout(step)
        if step.op == "reshape" and step.name.endswith("_heads"):
            return self.split(step)
        if step.op == "reshape" and step.name == "concat":
            return self.concat(step)
        if step.op == "repeat":
            return self.repeat(step)
        if step.op == "rope":
            return self.rope(step)
        if step.op == "bias":
            return self.bias(step)
        if step.op == "softcap":
            return self.softcap(step)
        if step.op == "score_mod":
            sec = self.section(step, t("explain.t_modified", self.lang, fn=step.params.get("fn", "score_mod")))
            self.result_tables(sec, step)
            return sec
        sec = self.section(step, step.name)
        self.result_tables(sec, step)
        return sec
