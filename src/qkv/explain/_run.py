"""Running a worked example through qkv's own computation path: :func:`run` (the whole trace) and
:func:`run_rows` (a large example, its (L, S) steps kept at some query rows only)."""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from qkv.explain._numbers import WorkedExampleError, text_of
from qkv.explain._options import _options, _plain_d_k
from qkv.explain._schema import _heads_problem
from qkv.explain._worked import Worked, _resolve_mask


def run(worked: Worked, *, heads: int | None = None, mask=None, trace=None):
    """Run a worked example through qkv's one orchestration of the stages and return the :class:`qkv.Trace`.

    Every example goes through :func:`qkv.pipeline.layer` (X examples: project Q, K, V; several heads split
    them, attend per head, concatenate, ``· W_O``) and :func:`qkv.pipeline.attend` — the functions
    :class:`qkv.MultiHeadAttention` and the reference backend run. Q/K examples and scores examples start at
    their step. The trace is checked afterwards: a step that overflowed (±inf or NaN where a number belongs)
    raises :class:`WorkedExampleError` naming it.

    Args:
        worked: the example.
        heads: override the number of heads (X examples whose projection widths divide by it).
        mask: override the file's ``mask:`` key: ``"causal"``, ``"none"``, or a boolean array (True = may
            attend); window, prefix, documents and sinks still combine with it.
        trace: a :class:`qkv.Trace` to record into (a new one by default). A trace with a ``substitute``
            (the checker's) continues with what it returns at every step.
    """
    from qkv.core.tracing import Trace

    if trace is None:
        trace = Trace()
    elif not isinstance(trace, Trace):
        raise TypeError(f"trace: expected a qkv.Trace or None, got {type(trace).__name__}")
    h, m = _heads_and_mask(worked, heads, mask)
    _execute(worked, h, m, trace, _Whole(worked, h, m))
    if trace.substitute is None:
        _check_finite(trace, worked)
    return trace


def _heads_and_mask(worked: Worked, heads, mask) -> tuple:
    if not isinstance(worked, Worked):
        raise TypeError(f"worked: expected a qkv.explain.examples.Worked, got {type(worked).__name__}")
    h = worked.heads if heads is None else heads
    if isinstance(h, bool) or not isinstance(h, numbers.Integral) or h < 1:
        raise ValueError(f"heads: expected a positive integer, got {h!r}")
    return int(h), _resolve_mask(worked, mask)


def _execute(worked: Worked, h: int, m, main, attend, row_block: int | None = None) -> None:
    """The example's steps into the trace ``main``: through :func:`qkv.pipeline.layer` from X, else from its
    Q and K (or scores) through ``attend`` (query rows by blocks of ``row_block``) and ``· W_O``."""
    from qkv.core import pipeline, stages
    from qkv.core.positions import RoPE
    from qkv.core.tracing import trace as tracing

    L, S = worked.n_queries, worked.n_keys
    rope = q_pos = k_pos = None
    if worked.rope is not None:
        rope = RoPE(theta=worked.rope["theta"], style=worked.rope["style"])
        q_pos = worked.positions if worked.positions is not None else np.arange(L, dtype=np.int64)
        k_pos = (worked.kv_positions if worked.kv_positions is not None
                 else q_pos if not worked.is_cross else np.arange(S, dtype=np.int64))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"), tracing(main):   # overflows: reported
        if worked.start == "X":
            if h > 1:
                _check_heads(worked, h, _plain_d_k(worked.d_k))
            x, x_kv = worked.X, worked.X_kv
            if h > 1:
                x, x_kv = x[None], None if x_kv is None else x_kv[None]                 # (1, L, D), (1, S, D_kv)
            pipeline.layer(x, worked.W_Q, worked.W_K, worked.W_V, worked.W_O, x_kv=x_kv,
                           heads=h if h > 1 else None, rope=rope, positions=q_pos, kv_positions=k_pos,
                           attend=attend, row_block=row_block)
            return
        if h > 1:
            _check_heads(worked, h, _plain_d_k(worked.d_k))                             # raises: not from X
        v = worked.V
        if worked.start == "QK":
            q, k = stages.observe_input("Q", worked.Q), stages.observe_input("K", worked.K)
            v = None if v is None else stages.observe_input("V", v)
            if rope is not None:
                q, k = rope(q, q_pos, name=stages.Names.Q_ROT), rope(k, k_pos, name=stages.Names.K_ROT)
            first = q
        else:
            first = stages.observe_input("scores", worked.scores, "scores (given)")     # in the queries' place
            k, v = None, None if v is None else stages.observe_input("V", v)
        out, _ = pipeline.attend_rows(attend, first, k, v, row_block)
        if worked.W_O is not None and out is not None:  # one head's output is its concat: · W_O as with several
            stages.project(out, worked.W_O, name="final_output", weight_name="W_O", input_name="output")


class _Whole:
    """The layer's ``attend`` for an example: :func:`qkv.pipeline.attend` with its mask, mods and sinks, on
    the rows it is given (all, for :func:`run`), recorded into the active trace."""

    def __init__(self, worked: Worked, h: int, m):
        d_k = _plain_d_k(worked.d_k)
        self.worked, self.h, self.m = worked, h, m
        self.d_k = d_k
        self.scores_first = worked.start == "scores"
        _options(worked, m, worked.n_queries, worked.n_keys, h, q_range=(0, 1))   # its errors come first

    def attend(self, first, k, v, rows, *, whole: bool = True):
        from qkv.core import pipeline

        w = self.worked
        L, S = w.n_queries, w.n_keys
        opts = _options(w, self.m, L, S, self.h, q_range=None if whole else rows)
        for key in ("rope", "q_positions", "k_positions"):                    # applied by the layer already
            opts.pop(key, None)
        q, scores = (None, first) if self.scores_first else (first, None)
        dd = self.d_k if self.d_k is not None else q.shape[-1]
        if "sink_logits" in opts and self.h == 1:  # one sink logit per head: the attention arrays get a head axis
            q, k, v, scores = (None if a is None else a[None] for a in (q, k, v, scores))
        out, _, _ = pipeline.attend(q, k, v, scale=1.0 / math.sqrt(dd), d_k=dd, scores=scores, **opts)
        return out, None

    __call__ = attend


#: Above this many attention weights (heads × L × S) ``qkv explain`` runs a worked example with
#: :func:`run_rows`: about 8 MB per (L, S) step in float64, where a full trace holds 5 or 6 of them.
LARGE_CELLS = 1 << 20
#: The attention weights one block of rows computes at a time in :func:`run_rows` (16 MB per float64 array).
BLOCK_CELLS = 1 << 21


def is_large(worked: Worked, heads: int | None = None) -> bool:
    """True when the example's attention (heads × L × S weights) is too large to keep whole in a trace."""
    h = worked.heads if heads is None else int(heads)
    return h * worked.n_queries * worked.n_keys > LARGE_CELLS


def run_rows(worked: Worked, rows, *, heads: int | None = None, mask=None, block_cells: int | None = None,
             substitute=None):
    """Run a worked example as :func:`run` does, keeping the (L, S) steps only at the query ``rows``.

    The same function (:func:`qkv.pipeline.layer`) computes the same numbers: the projections, the head
    split, RoPE, the concat and W_O on every row, recorded whole; the attention part (scores → scaled →
    [biased, capped] → masked → weights → output) in blocks of query rows (the layer's ``row_block``:
    ``block_cells`` weights at a time; every query row's attention needs only its own q and all of K and V),
    each block recorded into a trace of its own that is read and dropped. Those steps keep their array, and
    their row-indexed operands, at ``rows`` only, with ``params``: ``rows`` (the true row indices),
    ``full_shape``, ``stats`` (per (batch, head) slice: count, min, max and mean of the finite values over
    every row) and ``row_operands``; :mod:`qkv.explain.render` writes such a trace as it writes a whole one.
    The output step holds the kept rows; the concat after it is of every row.

    Memory is O(rows × S + block) instead of O(L × S) for each of the 5–6 steps a trace keeps: a 10,000-token
    example needs about 200 MB, not 13 GB. Float64 throughout (the numbers are the ones :func:`run` gives).

    ``substitute(name, array, row0)``, when given, is the checker's: every step's result passes through it as
    through a :class:`qkv.Trace`'s ``substitute`` (and the steps are not checked for overflow, as in
    :func:`run`); ``row0`` is the true index of the array's first query row (0 for the steps kept whole).
    """
    from qkv.core.tracing import Trace

    h, m = _heads_and_mask(worked, heads, mask)
    L, S = worked.n_queries, worked.n_keys
    keep = sorted({int(r) for r in rows})
    if not keep or keep[0] < 0 or keep[-1] >= L:
        raise ValueError(f"rows: expected row indices 0..{L - 1}, got {list(rows)!r}")
    main = Trace(substitute=None if substitute is None else functools.partial(_at_row, substitute, 0))
    block = max(1, int(block_cells or BLOCK_CELLS) // max(1, h * S))
    blocks = _Blocks(worked, h, m, main, keep, substitute)
    _execute(worked, h, m, main, blocks, row_block=block)
    if substitute is None:
        _check_finite(main, worked)
    return main


class _Blocks(_Whole):
    """:func:`run_rows`'s ``attend``: each block of query rows through :func:`qkv.pipeline.attend` into a
    trace of its own, merged (its stats over every row, the kept rows) and dropped; after the last block the
    merged steps are recorded into the main trace, where the layer goes on (concat, ``· W_O``)."""

    def __init__(self, worked: Worked, h: int, m, main, keep: list[int], substitute):
        super().__init__(worked, h, m)
        self.main, self.keep, self.substitute = main, keep, substitute
        self.keep_set = set(keep)
        self.merged: dict = {}
        self.order: list[str] = []

    def __call__(self, first, k, v, rows):
        from qkv.core.tracing import Trace
        from qkv.core.tracing import trace as tracing

        r0, r1 = rows
        L = self.worked.n_queries
        sub = None if self.substitute is None else functools.partial(_at_row, self.substitute, r0)
        bt = Trace(substitute=sub)
        with tracing(bt):
            out, _ = self.attend(first, k, v, rows, whole=False)
        if self.substitute is None:
            _check_finite(bt, self.worked)
        local = [i - r0 for i in range(r0, r1) if i in self.keep_set]
        for st in bt:
            _merge_step(self.merged, self.order, st, r0, r1, local)
        if r1 == L:                                                   # the last block: into the main trace
            _record_kept(self.main, self.merged, self.order, self.keep, L)
        return out, None


def _merge_step(merged: dict, order: list[str], st, r0: int, r1: int, local: list[int]) -> None:
    """One block's step into its merged record: the stats over every row, the kept rows (and row-indexed
    operands)."""
    rec = merged.get(st.name)
    if rec is None:
        order.append(st.name)
        row_ops = tuple(key for key, val in st.operands.items()
                        if isinstance(val, np.ndarray) and val.ndim >= 2 and val.shape[-2] == r1 - r0
                        and (st.op != "matmul" or key == "a"))
        rec = merged[st.name] = {"first": st, "pieces": [], "ops": {key: [] for key in row_ops},
                                 "stats": {}}
    a = np.asarray(st.array)
    for li in np.ndindex(*a.shape[:-2]):
        sl = a[li]
        finite = sl[np.isfinite(sl)]
        n, lo, hi, tot, cnt = rec["stats"].get(li, (0, np.inf, -np.inf, 0.0, 0))
        if finite.size:
            lo, hi = min(lo, float(finite.min())), max(hi, float(finite.max()))
            tot, cnt = tot + float(finite.sum(dtype=np.float64)), cnt + finite.size
        rec["stats"][li] = (n + sl.size, lo, hi, tot, cnt)
    if local:
        rec["pieces"].append(a[..., local, :].copy())
        for key in rec["ops"]:
            val = np.asarray(st.operands[key])
            rec["ops"][key].append(val[..., local, :].copy())


def _record_kept(main, merged: dict, order: list[str], keep: list[int], L: int) -> None:
    """Record each merged step into ``main``: its kept rows, with ``rows``, ``full_shape``, ``stats`` and
    ``row_operands`` in its params."""
    from qkv.core.tracing import Step

    for name in order:
        rec = merged[name]
        first = rec["first"]
        arr = np.concatenate(rec["pieces"], axis=-2)
        operands = dict(first.operands)
        for key, pieces in rec["ops"].items():
            operands[key] = np.concatenate(pieces, axis=-2)
        stats = {li: (n, lo, hi, tot / cnt) for li, (n, lo, hi, tot, cnt) in rec["stats"].items() if cnt}
        params = dict(first.params, rows=np.asarray(keep), full_shape=arr.shape[:-2] + (L, arr.shape[-1]),
                      stats=stats, row_operands=tuple(rec["ops"]))
        main.record(Step(name=name, op=first.op, formula=first.formula, array=arr, operands=operands,
                         params=params))


def _at_row(substitute, row0: int, name: str, array):
    return substitute(name, array, row0)


#: steps whose −∞ entries are the mask's doing (not an overflow)
_MAY_HOLD_MINUS_INF = frozenset({"masked"})


def _check_finite(trace, worked: Worked) -> None:
    """Raise :class:`WorkedExampleError` at the first recorded step holding ±inf or NaN (a masked score's −∞
    aside): the numbers overflowed float64 there (e.g. scores of 1e200-sized vectors)."""
    for step in trace:
        a = np.asarray(step.array)
        if a.dtype.kind != "f":
            continue
        bad = np.isnan(a) | (np.isposinf(a) if step.name in _MAY_HOLD_MINUS_INF else np.isinf(a))
        if not bad.any():
            continue
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        value = "NaN" if np.isnan(a[idx]) else ("inf" if a[idx] > 0 else "-inf")
        where = worked.name or "worked example"
        raise WorkedExampleError(
            f"{where}: {step.name} overflowed: {step.name}{list(idx)} = {value} (float64 holds numbers up to "
            f"about 1.8e308); expected finite {step.name} — scale the inputs down")


def _check_heads(worked, h: int, d_k) -> None:
    """Several heads (``h`` > 1) need an example that starts from X, weights that split into ``h`` heads, and a
    ``d_k`` (when given) equal to each head's width."""
    start = worked.start
    if start != "X":
        raise ValueError(f"heads: several heads need an example that starts from X (this one starts from "
                         f"{'Q and K' if start == 'QK' else 'scores'})")
    problem = _heads_problem(worked.W_Q, worked.W_K, worked.W_V, worked.W_O, h)
    if problem:
        raise ValueError(problem)
    F = worked.W_Q.shape[1]
    if d_k is not None and float(d_k) != F // h:
        raise ValueError(f"heads: d_k = {text_of(worked.d_k)} but {h} heads have width {F // h}")
