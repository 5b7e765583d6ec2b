"""Running a worked example through qkv's own computation path: :func:`run` (the whole trace) and
:func:`run_rows` (a large example, its (L, S) steps kept at some query rows only)."""
from __future__ import annotations

import functools
import math
import numbers

import numpy as np

from ._numbers import WorkedExampleError, text_of
from ._options import _options, _plain_d_k
from ._schema import _heads_problem
from ._worked import Worked, _resolve_mask


def run(worked: Worked, *, heads: int | None = None, mask=None, trace=None):
    """Run a worked example through qkv's one orchestration of the stages and return the :class:`qkv.Trace`.

    Every example goes through :func:`qkv.pipeline.attend` (the reference backend's own function): X examples
    project Q, K, V with :func:`qkv.stages.project` first; several heads split them (``split_heads``), attend
    per head and concatenate (``merge_heads``, then ``· W_O``) — with square projections through
    :class:`qkv.MultiHeadAttention` itself. Q/K examples and scores examples start at their step. The trace
    is checked afterwards: a step that overflowed (±inf or NaN where a number belongs) raises
    :class:`WorkedExampleError` naming it.

    Args:
        worked: the example.
        heads: override the number of heads (X examples whose projection widths divide by it).
        mask: override the file's ``mask:`` key: ``"causal"``, ``"none"``, or a boolean array (True = may
            attend); window, prefix, documents and sinks still combine with it.
        trace: a :class:`qkv.Trace` to record into (a new one by default). A trace with a ``substitute``
            (the checker's) continues with what it returns at every step.
    """
    from ..tracing import Trace

    if not isinstance(worked, Worked):
        raise TypeError(f"worked: expected a qkv.explain.examples.Worked, got {type(worked).__name__}")
    if trace is None:
        trace = Trace()
    elif not isinstance(trace, Trace):
        raise TypeError(f"trace: expected a qkv.Trace or None, got {type(trace).__name__}")
    h = worked.heads if heads is None else heads
    if isinstance(h, bool) or not isinstance(h, numbers.Integral) or h < 1:
        raise ValueError(f"heads: expected a positive integer, got {h!r}")
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):    # an overflow is reported below
        _forward(worked, int(h), _resolve_mask(worked, mask), trace)
    if trace.substitute is None:
        _check_finite(trace, worked)
    return trace


def _forward(worked: Worked, h: int, m, trace) -> None:
    from .. import pipeline, stages
    from ..mha import MultiHeadAttention
    from ..tracing import trace as tracing

    L, S = worked.n_queries, worked.n_keys
    opts = _options(worked, m, L, S, h)
    d_k = _plain_d_k(worked.d_k)
    start = worked.start
    if h > 1:
        _check_heads(worked, h, d_k)
        D = worked.X.shape[1]
        x_kv = worked.X_kv
        plain = set(opts) <= {"mask", "mask_source"}
        square = (worked.W_Q.shape == (D, D) and worked.W_K.shape[1] == D and worked.W_V.shape[1] == D
                  and (worked.W_O is None or worked.W_O.shape == (D, D)))
        if square and plain:                       # the real MultiHeadAttention (it runs pipeline.attend)
            mha = MultiHeadAttention(D, h, bias=False, kdim=None if x_kv is None else x_kv.shape[1],
                                     vdim=None if x_kv is None else x_kv.shape[1], dtype=np.float64)
            W_O = worked.W_O if worked.W_O is not None else np.eye(D)
            mha.load(W_Q=worked.W_Q, W_K=worked.W_K, W_V=worked.W_V, W_O=W_O)
            causal = isinstance(m, str)
            mha.forward(worked.X, x_kv, x_kv, attn_mask=None if causal else m, is_causal=causal, trace=trace)
            return
        # MultiHeadAttention's stages in its order (other widths, e.g. seed 003's 4×3 split into 3 heads of
        # 1, or the variants): project, split_heads, pipeline.attend on every head, merge_heads, [· W_O]
        with tracing(trace):
            x = stages.observe_input("X", worked.X[None])                              # (1, L, D)
            kv = x if x_kv is None else stages.observe_input("X_kv", x_kv[None])       # (1, S, D_kv)
            kv_name = "X" if x_kv is None else "X_kv"
            q = stages.project(x, worked.W_Q, name="Q", weight_name="W_Q", input_name="X")
            k = stages.project(kv, worked.W_K, name="K", weight_name="W_K", input_name=kv_name)
            v = stages.project(kv, worked.W_V, name="V", weight_name="W_V", input_name=kv_name)
            q, k, v = (stages.split_heads(a, h, name=n) for a, n in ((q, "Q"), (k, "K"), (v, "V")))
            E = q.shape[-1]
            out, _, _ = pipeline.attend(q, k, v, scale=1.0 / math.sqrt(E if d_k is None else d_k), d_k=d_k,
                                        **opts)                                         # (1, H, L, Ev)
            out = stages.merge_heads(out)                                               # (1, L, H·Ev)
            if worked.W_O is not None:
                stages.project(out, worked.W_O, name="final_output", weight_name="W_O", input_name="concat")
        return
    with tracing(trace):
        if start == "X":
            x = stages.observe_input("X", worked.X)                                     # (L, D)
            kv = x if worked.X_kv is None else stages.observe_input("X_kv", worked.X_kv)  # (S, D_kv)
            kv_name = "X" if worked.X_kv is None else "X_kv"
            q = stages.project(x, worked.W_Q, name="Q", weight_name="W_Q", input_name="X")         # (L, E)
            k = stages.project(kv, worked.W_K, name="K", weight_name="W_K", input_name=kv_name)    # (S, E)
            v = stages.project(kv, worked.W_V, name="V", weight_name="W_V", input_name=kv_name)    # (S, Ev)
            scores = None
        elif start == "QK":
            q = stages.observe_input("Q", worked.Q)
            k = stages.observe_input("K", worked.K)
            v = None if worked.V is None else stages.observe_input("V", worked.V)
            scores = None
        else:
            q = k = None
            scores = stages.observe_input("scores", worked.scores, "scores (given)")
            v = None if worked.V is None else stages.observe_input("V", worked.V)
        width = q.shape[-1] if q is not None else None
        dd = d_k if d_k is not None else width
        if "sink_logits" in opts:               # one sink logit per head: the attention arrays get a head axis
            q, k, v, scores = (None if a is None else a[None] for a in (q, k, v, scores))
        out, _, _ = pipeline.attend(q, k, v, scale=1.0 / math.sqrt(dd), d_k=dd, scores=scores, **opts)
        if worked.W_O is not None:              # one head's output is its concat: · W_O as with several
            stages.project(out, worked.W_O, name="final_output", weight_name="W_O", input_name="output")


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

    The same stages compute the same numbers: the projections, the head split, RoPE, the concat and W_O on
    every row, recorded whole; the attention part (scores → scaled → [biased, capped] → masked → weights →
    output) in blocks of query rows (``block_cells`` weights at a time; every query row's attention needs only
    its own q and all of K and V), each block recorded into a trace of its own that is read and dropped. Those
    steps keep their array, and their row-indexed operands, at ``rows`` only, with ``params``: ``rows`` (the
    true row indices), ``full_shape``, ``stats`` (per (batch, head) slice: count, min, max and mean of the
    finite values over every row) and ``row_operands``; :mod:`qkv.explain.render` writes such a trace as it
    writes a whole one. The output step holds the kept rows; the concat after it is of every row.

    Memory is O(rows × S + block) instead of O(L × S) for each of the 5–6 steps a trace keeps: a 10,000-token
    example needs about 200 MB, not 13 GB. Float64 throughout (the numbers are the ones :func:`run` gives).

    ``substitute(name, array, row0)``, when given, is the checker's: every step's result passes through it as
    through a :class:`qkv.Trace`'s ``substitute`` (and the steps are not checked for overflow, as in
    :func:`run`); ``row0`` is the true index of the array's first query row (0 for the steps kept whole).
    """
    from ..tracing import Trace
    from ..tracing import trace as tracing

    if not isinstance(worked, Worked):
        raise TypeError(f"worked: expected a qkv.explain.examples.Worked, got {type(worked).__name__}")
    h = worked.heads if heads is None else heads
    if isinstance(h, bool) or not isinstance(h, numbers.Integral) or h < 1:
        raise ValueError(f"heads: expected a positive integer, got {h!r}")
    h = int(h)
    L = worked.n_queries
    keep = sorted({int(r) for r in rows})
    if not keep or keep[0] < 0 or keep[-1] >= L:
        raise ValueError(f"rows: expected row indices 0..{L - 1}, got {list(rows)!r}")
    m = _resolve_mask(worked, mask)
    d_k = _plain_d_k(worked.d_k)
    main = Trace(substitute=None if substitute is None else functools.partial(_at_row, substitute, 0))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"), tracing(main):
        q, k, v, scores, dd = _rows_inputs(worked, h, d_k)
    if substitute is None:
        _check_finite(main, worked)
    merged, order, out_full = _attend_blocks(worked, m, h, q, k, v, scores, dd, keep, block_cells, substitute)
    _record_kept(main, merged, order, keep, L)
    _rows_output(main, worked, m, h, out_full)
    if substitute is None:
        _check_finite(main, worked)
    return main


def _rows_inputs(worked: Worked, h: int, d_k) -> tuple:
    """:func:`run_rows`'s steps before attention, on every row and recorded whole: the inputs, the projections,
    the head split, RoPE. Returns q, k, v, scores (the given ones, else None) and the d in √d_k."""
    from .. import stages
    from ..positions import RoPE
    from ..stages import Names

    L, S = worked.n_queries, worked.n_keys
    start = worked.start
    q_pos = k_pos = None
    if worked.rope is not None:
        q_pos = worked.positions if worked.positions is not None else np.arange(L, dtype=np.int64)
        k_pos = (worked.kv_positions if worked.kv_positions is not None
                 else q_pos if not worked.is_cross else np.arange(S, dtype=np.int64))
    scores = None
    if h > 1:
        _check_heads(worked, h, d_k)
        x = stages.observe_input("X", worked.X[None])                              # (1, L, D)
        kv = x if worked.X_kv is None else stages.observe_input("X_kv", worked.X_kv[None])
        kv_name = "X" if worked.X_kv is None else "X_kv"
        q = stages.project(x, worked.W_Q, name="Q", weight_name="W_Q", input_name="X")
        k = stages.project(kv, worked.W_K, name="K", weight_name="W_K", input_name=kv_name)
        v = stages.project(kv, worked.W_V, name="V", weight_name="W_V", input_name=kv_name)
        q, k, v = (stages.split_heads(a, h, name=n) for a, n in ((q, "Q"), (k, "K"), (v, "V")))
        width = q.shape[-1]
    else:
        if start == "X":
            x = stages.observe_input("X", worked.X)
            kv = x if worked.X_kv is None else stages.observe_input("X_kv", worked.X_kv)
            kv_name = "X" if worked.X_kv is None else "X_kv"
            q = stages.project(x, worked.W_Q, name="Q", weight_name="W_Q", input_name="X")
            k = stages.project(kv, worked.W_K, name="K", weight_name="W_K", input_name=kv_name)
            v = stages.project(kv, worked.W_V, name="V", weight_name="W_V", input_name=kv_name)
        elif start == "QK":
            q = stages.observe_input("Q", worked.Q)
            k = stages.observe_input("K", worked.K)
            v = None if worked.V is None else stages.observe_input("V", worked.V)
        else:
            q = k = None
            scores = stages.observe_input("scores", worked.scores, "scores (given)")
            v = None if worked.V is None else stages.observe_input("V", worked.V)
        width = q.shape[-1] if q is not None else None
        if worked.sink_logits is not None:          # one sink logit per head: a head axis (as run() does)
            q, k, v, scores = (None if a is None else a[None] for a in (q, k, v, scores))
    dd = d_k if d_k is not None else width
    if worked.rope is not None:                     # RoPE on every row, before the blocks (as attend does)
        rope = RoPE(theta=worked.rope["theta"], style=worked.rope["style"])
        q = rope(q, q_pos, name=Names.Q_ROT)
        k = rope(k, k_pos, name=Names.K_ROT)
    return q, k, v, scores, dd


def _attend_blocks(worked: Worked, m, h: int, q, k, v, scores, dd, keep: list[int], block_cells, substitute):
    """:func:`run_rows`'s attention, by blocks of query rows, each block's trace merged and dropped: returns
    {step name: its merged record}, the step names in order, and the output at every row (or None)."""
    from .. import pipeline
    from ..tracing import Trace
    from ..tracing import trace as tracing

    L, S = worked.n_queries, worked.n_keys
    lead = (q if q is not None else scores).shape[:-2]
    n_lead = max(1, int(np.prod(lead)))
    block = max(1, int(block_cells or BLOCK_CELLS) // max(1, n_lead * S))
    keep_set = set(keep)
    merged: dict = {}
    order: list[str] = []
    out_full = None
    for r0 in range(0, L, block):
        r1 = min(L, r0 + block)
        opts = _options(worked, m, L, S, h, q_range=(r0, r1))
        opts.pop("rope", None), opts.pop("q_positions", None), opts.pop("k_positions", None)
        bt = Trace(substitute=None if substitute is None else functools.partial(_at_row, substitute, r0))
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"), tracing(bt):
            pipeline.attend(None if q is None else q[..., r0:r1, :], k, v, scale=1.0 / math.sqrt(dd), d_k=dd,
                            scores=None if scores is None else scores[..., r0:r1, :], **opts)
        if substitute is None:
            _check_finite(bt, worked)
        local = [i - r0 for i in range(r0, r1) if i in keep_set]
        for st in bt:
            out_full = _merge_step(merged, order, st, r0, r1, local, L, out_full)
        del bt
    return merged, order, out_full


def _merge_step(merged: dict, order: list[str], st, r0: int, r1: int, local: list[int], L: int, out_full):
    """One block's step into its merged record: the stats over every row, the kept rows (and row-indexed
    operands); the output's rows into ``out_full`` (made at the first block). Returns ``out_full``."""
    from ..stages import Names

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
    if st.name == Names.OUTPUT:
        if out_full is None:
            out_full = np.empty(a.shape[:-2] + (L, a.shape[-1]), dtype=a.dtype)
        out_full[..., r0:r1, :] = a
    if local:
        rec["pieces"].append(a[..., local, :].copy())
        for key in rec["ops"]:
            val = np.asarray(st.operands[key])
            rec["ops"][key].append(val[..., local, :].copy())
    return out_full


def _record_kept(main, merged: dict, order: list[str], keep: list[int], L: int) -> None:
    """Record each merged step into ``main``: its kept rows, with ``rows``, ``full_shape``, ``stats`` and
    ``row_operands`` in its params."""
    from ..tracing import Step

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


def _rows_output(main, worked: Worked, m, h: int, out_full) -> None:
    """:func:`run_rows`'s steps after attention, on every row, as :func:`run` has them: the concat of the
    heads and ``· W_O``."""
    from .. import stages
    from ..tracing import trace as tracing

    L, S = worked.n_queries, worked.n_keys
    if h == 1 and out_full is not None and worked.W_O is not None:      # as run(): one head's output · W_O
        with tracing(main):
            stages.project(out_full, worked.W_O, name="final_output", weight_name="W_O", input_name="output")
    if h > 1 and out_full is not None:
        W_O = worked.W_O
        D = worked.X.shape[1]
        plain = set(_options(worked, m, L, S, h, q_range=(0, 1))) <= {"mask", "mask_source"}
        square = (worked.W_Q.shape == (D, D) and worked.W_K.shape[1] == D and worked.W_V.shape[1] == D
                  and (W_O is None or W_O.shape == (D, D)))
        if W_O is None and square and plain:          # as run(): MultiHeadAttention, whose W_O is the identity
            W_O = np.eye(D)
        with tracing(main):
            out = stages.merge_heads(out_full)                                          # (1, L, H·Ev)
            if W_O is not None:
                stages.project(out, W_O, name="final_output", weight_name="W_O", input_name="concat")


def _at_row(substitute, row0: int, name: str, array):
    return substitute(name, array, row0)


#: steps whose −∞ entries are the mask's doing (not an overflow)
_MAY_HOLD_MINUS_INF = {"masked"}


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
