"""The ring, simulated in one process and written out step by step (``qkv explain --ring P``).

:func:`trace_ring` runs exactly what every rank of :func:`qkv.distributed.ring_attention` runs — the same step
plans (:mod:`qkv.distributed._plan`), the same tiled-engine block calls, the same log-sum-exp merge
(:func:`qkv.merge.merge_partials`) — for all P ranks in turn, with the transfers replaced by handing the
arrays over, and keeps every partial result. :func:`build_doc` writes it as a :class:`qkv.explain.doc.Doc`
(text, markdown, JSON, rich; every word from ``qkv.locales``, ``ring.*`` keys): who holds which positions, at
each step which K/V block each rank holds and what it computes (or skips), the partial outputs and
log-sum-exps, the merge with its numbers, the result against the single-process attention, and the messages.
NumPy only: no torch, no processes.
"""
from __future__ import annotations

import types

from dataclasses import dataclass, field

import numpy as np

from qkv import _checks
from qkv.locales import t
from qkv.core.merge import merge_partials
from qkv.integrations.distributed import _layout, _plan


@dataclass
class RankStep:
    """What one rank did at one step."""
    rank: int
    src: int                                  # whose K/V block it held
    blocks: list                              # the _plan.Block calls (empty: skipped)
    partial: list = field(default_factory=list)   # per block: (out (…, rows, Ev), lse (…, rows))
    before: tuple | None = None               # (out, lse) of the whole shard before the step
    after: tuple | None = None                # … and after


@dataclass
class RingTrace:
    """The simulated ring (see :func:`trace_ring`)."""
    world_size: int
    layout: str
    N: int
    n: int
    is_causal: bool
    mask_mod: object
    scale: float
    positions: list                           # per rank: the global position of each local row
    steps: list                               # per step: [RankStep for each rank]
    n_steps: int
    outputs: list                             # per rank: (out, lse)
    output: np.ndarray                        # unsharded (…, L, Ev)
    reference: np.ndarray                     # the single-process attention
    max_error: float
    kv_bytes: int                             # one K/V message
    mask_name: str | None = None


def trace_ring(query, key, value, world_size, *, is_causal=False, scale=None, enable_gqa=False, layout="zigzag",
               mask_mod=None, mask_name=None) -> RingTrace:
    """Simulate :func:`qkv.distributed.ring_attention` on ``world_size`` ranks in this process.

    Args:
        query, key, value: the *whole* sequence, (..., Hq, N, E) / (..., Hk, N, E) / (..., Hk, N, Ev).
        world_size: P.
        is_causal, scale, enable_gqa, layout, mask_mod: as :func:`qkv.distributed.ring_attention`.
        mask_name: how to name the mask in the explanation (default: the mod's repr).

    Returns:
        a :class:`RingTrace`; its ``max_error`` is the largest difference between the unsharded ring output and
        the single-process attention.
    """
    from qkv.engine import flex, sdpa
    from qkv.integrations.distributed._ring import _validate
    P = int(world_size)
    if P < 1:
        raise ValueError(f"world_size: expected an integer >= 1, got {world_size!r}")
    layout = _layout.check_layout(layout)
    N = np.shape(query)[-2] if np.ndim(query) >= 2 else 0
    err = _layout.length_error(N, P, layout)
    if err:
        raise ValueError(f"trace_ring: {err}")
    full = _validate("trace_ring", query, key, value, is_causal, scale, enable_gqa, layout, mask_mod, 1)
    n = N // P
    q, k, v = full.query, full.key, full.value
    shards = [[_layout.shard(x, r, P, layout=layout) for x in (q, k, v)] for r in range(P)]
    mod = _plan.effective_mod(full.is_causal, mask_mod)
    plans = [_plan.plans(r, P, n, layout, full.is_causal, mod, full.lead) for r in range(P)]
    n_steps = max(max(_plan.last_step(p) for p in plans) + 1, 1)
    cdt = _checks.compute_dtype(q.dtype)
    Ev = v.shape[-1]
    acc = [(np.zeros(full.lead + (n, Ev), cdt), np.full(full.lead + (n,), -np.inf, cdt)) for _ in range(P)]
    steps = []
    for s in range(n_steps):
        row = []
        for r in range(P):
            src = (r - s) % P
            rs = RankStep(r, src, plans[r][s])
            rs.before = (acc[r][0].copy(), acc[r][1].copy())
            kk, vv = shards[src][1], shards[src][2]
            for blk in rs.blocks:
                o, lse = _plan.forward_block(shards[r][0].astype(cdt), kk, vv, blk, scale=full.scale,
                                             enable_gqa=full.enable_gqa, threads=1)
                rs.partial.append((o, lse))
                a_out, a_lse = acc[r][0][..., blk.q0:blk.q1, :], acc[r][1][..., blk.q0:blk.q1]
                merge_partials(a_out, a_lse, o, lse, out=(a_out, a_lse))
            rs.after = (acc[r][0].copy(), acc[r][1].copy())
            row.append(rs)
        steps.append(row)
    output = _layout.unshard([a[0] for a in acc], layout=layout)
    if mod is None:
        ref = sdpa.scaled_dot_product_attention(q, k, v, is_causal=full.is_causal, scale=full.scale,
                                                enable_gqa=full.enable_gqa, backend="reference")
    else:
        bm = flex.create_block_mask(mod, None, None, N, N)
        ref = np.asarray(flex.flex_attention(q, k, v, block_mask=bm, scale=full.scale, enable_gqa=full.enable_gqa,
                                             backend="reference"))
    max_error = float(np.max(np.abs(output - ref), initial=0.0))
    kv_bytes = shards[0][1].nbytes + shards[0][2].nbytes
    return RingTrace(P, layout, N, n, full.is_causal, mask_mod, full.scale,
                     [_layout.positions(r, P, n, layout) for r in range(P)], steps, n_steps, acc, output, ref,
                     max_error, kv_bytes, mask_name if mask_name is not None or mask_mod is None else repr(mask_mod))


# ---------------------------------------------------------------------------------------------- the doc
def _runs(pos) -> str:
    """Positions as runs: [0 1 2 3 12 13] → "0–3, 12–13"."""
    pos = [int(p) for p in pos]
    out, start = [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1:
            a, b = pos[start], pos[i - 1]
            out.append(str(a) if a == b else f"{a}–{b}")
            start = i
    return ", ".join(out)


def _intro(doc, tr: RingTrace, lang: str, lead: tuple) -> None:
    """The doc's introduction: the sequence, the layout, the mask, the slice shown."""
    P, n = tr.world_size, tr.n
    k = _layout.units(P, tr.layout)
    doc.intro.append(t("ring.intro", lang, N=tr.N, P=P))
    doc.intro.append(t("ring.layout_zigzag", lang, k=k, c=tr.N // k) if tr.layout == "zigzag"
                     else t("ring.layout_contiguous", lang, n=n))
    if tr.mask_name is not None:
        doc.intro.append(t("ring.mask_mod", lang, mod=tr.mask_name))
    elif tr.is_causal:
        doc.intro.append(t("ring.mask_causal", lang))
    else:
        doc.intro.append(t("ring.mask_none", lang))
    if lead and int(np.prod(lead)) > 1:
        doc.intro.append(t("ring.slice_note", lang, count=int(np.prod(lead))))


def _merge_lines(tr: RingTrace, rs: RankStep, idx: tuple, label, vec, fmt, precision: int) -> tuple:
    """One rank's merge at one step, row by row: ``(rows, vals, lines)`` for its table and calculation."""
    rows, vals, lines = [], [], []
    for blk, (o, lse) in zip(rs.blocks, rs.partial):
        for i in range(blk.q1 - blk.q0):
            loc = blk.q0 + i
            pos = int(tr.positions[rs.rank][loc])
            a_l, b_l = float(rs.before[1][idx + (loc,)]), float(lse[idx + (i,)])
            a_o, b_o = rs.before[0][idx + (loc,)], o[idx + (i,)]
            m_l, m_o = float(rs.after[1][idx + (loc,)]), rs.after[0][idx + (loc,)]
            rows.append(label(pos))
            vals.append([b_l] + [float(x) for x in b_o] + [m_l] + [float(x) for x in m_o])
            if np.isneginf(m_l):
                wa = wb = 0.0
            else:
                wa, wb = float(np.exp(a_l - m_l)), float(np.exp(b_l - m_l))
            lines.append(f"{label(pos)}: lse = log(e^{fmt(a_l, precision)} + e^{fmt(b_l, precision)}) = "
                         f"{fmt(m_l, precision)};  out = {fmt(wa, precision)}·{vec(a_o)} + "
                         f"{fmt(wb, precision)}·{vec(b_o)} = {vec(m_o)}")
    return rows, vals, lines


def _rank_step(sec, tr: RingTrace, s: int, rs: RankStep, lang: str, idx: tuple, label, vec, precision: int):
    """What one rank did at step s: the block it held, the blocks it computed, its merge table and lines."""
    from qkv.explain.doc import Table, fmt
    keys = _runs(tr.positions[rs.src])
    sec.text(t("ring.holds", lang, r=rs.rank, src=rs.src, keys=keys))
    if not rs.blocks:
        sec.text(t("ring.skipped", lang, r=rs.rank))
        return
    for blk in rs.blocks:
        qpos = _runs(tr.positions[rs.rank][blk.q0:blk.q1])
        kpos = _runs(tr.positions[rs.src][blk.k0:blk.k1])
        kind = {"full": t("ring.kind_full", lang), "causal": t("ring.kind_causal", lang)}.get(
            blk.kind, t("ring.kind_mask", lang, mod=tr.mask_name or ""))
        sec.text(t("ring.block", lang, r=rs.rank, q=qpos, k=kpos, kind=kind))
    rows, vals, lines = _merge_lines(tr, rs, idx, label, vec, fmt, precision)
    Ev = tr.output.shape[-1]
    cols = ([t("ring.col_block_lse", lang)] + [t("ring.col_block_out", lang, j=j) for j in range(Ev)]
            + [t("ring.col_lse", lang)] + [t("ring.col_out", lang, j=j) for j in range(Ev)])
    sec.table(Table(t("ring.table", lang, r=rs.rank, s=s), rows, cols, vals))
    sec.calc(lines)


def _result_section(sec, tr: RingTrace, lang: str, idx: tuple, label) -> None:
    """The unsharded ring output next to the single-process attention, and their largest difference."""
    from qkv.explain.doc import Table, fmt
    Ev = tr.output.shape[-1]
    out_rows, out_vals = [], []
    for pos in range(tr.N):
        out_rows.append(label(pos))
        out_vals.append([float(x) for x in tr.output[idx + (pos,)]] + [float(x) for x in tr.reference[idx + (pos,)]])
    cols = [t("ring.col_ring", lang, j=j) for j in range(Ev)] + [t("ring.col_single", lang, j=j) for j in range(Ev)]
    sec.table(Table(t("ring.t_result_table", lang), out_rows, cols, out_vals))
    sec.text(t("ring.n_result", lang, err=fmt(tr.max_error, 2) if tr.max_error else "0"))


def build_doc(tr: RingTrace, lang: str = "en", precision: int = 4, tokens=None):
    """The ring trace as a :class:`qkv.explain.doc.Doc` (see the module doc)."""
    from qkv.explain.doc import Doc, Section, Table, fmt
    P, n = tr.world_size, tr.n

    def label(pos: int) -> str:
        return f"{tokens[pos]} ({pos})" if tokens is not None and pos < len(tokens) else str(pos)

    def vec(x) -> str:
        return "[" + ", ".join(fmt(a, precision) for a in np.ravel(x)) + "]"

    lead = tr.output.shape[:-2]
    idx = (0,) * len(lead)                                  # the slice shown
    doc = Doc(title=t("ring.title", lang, P=P), lang=lang)
    _intro(doc, tr, lang, lead)
    n_sec = [0]

    def section(step: str, title: str) -> Section:
        n_sec[0] += 1
        return Section(step=step, title=f"{t('explain.step', lang, n=n_sec[0])} · {title}")

    sec = section("ring_shards", t("ring.t_shards", lang))
    sec.text(t("ring.n_shards", lang, P=P, n=n))
    sec.table(Table(t("ring.col_rank", lang), [str(r) for r in range(P)], [str(i) for i in range(n)],
                    [[label(int(p)) for p in tr.positions[r]] for r in range(P)], note=t("ring.shards_note", lang)))
    doc.sections.append(sec)

    for s, row in enumerate(tr.steps):
        sec = section(f"ring_step_{s}", t("ring.t_step", lang, s=s))
        last = s + 1 == tr.n_steps
        sec.text(t("ring.n_last", lang) if last else t("ring.n_send", lang, bytes=tr.kv_bytes))
        if any(rs.blocks for rs in row):
            sec.text(t("ring.n_merge", lang))
        for rs in row:
            _rank_step(sec, tr, s, rs, lang, idx, label, vec, precision)
        doc.sections.append(sec)
    if tr.n_steps < P:
        doc.sections[-1].text(t("ring.stop_early", lang, n=tr.n_steps, first=tr.n_steps, last=P - 1))

    sec = section("ring_result", t("ring.t_result", lang))
    _result_section(sec, tr, lang, idx, label)
    doc.sections.append(sec)

    sec = section("ring_comm", t("ring.t_comm", lang))
    m = tr.n_steps - 1
    sec.text(t("ring.n_comm", lang, m=m, b=tr.kv_bytes, total=m * tr.kv_bytes, p1=P - 1))
    doc.sections.append(sec)
    return doc


# ---------------------------------------------------------------------------------------------- explain
#: ``qkv explain --ring P`` without an example: 8 positions, one head of width 2, causal.
DEFAULT_EXAMPLE = types.MappingProxyType({
    "Q": [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, -0.5], [-1.0, 0.5], [0.0, -1.0], [1.0, -1.0], [0.5, 0.5]],
    "K": [[0.5, 0.5], [1.0, 0.0], [0.0, 1.0], [-0.5, 1.0], [1.0, 1.0], [0.5, -1.0], [-1.0, 0.0], [0.0, 0.5]],
    "V": [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0], [0.0, 2.0], [1.0, -1.0], [-1.0, 1.0], [0.5, 0.5]],
})


def default_worked():
    """:data:`DEFAULT_EXAMPLE` as a worked example (causal)."""
    from qkv.explain import examples as ex
    return ex.from_dict(dict(DEFAULT_EXAMPLE, mask="causal"), name="ring")


def explain(worked, world_size: int, *, layout=None, mask=None, lang: str = "en", precision: int = 4):
    """The ring trace of a worked example as a Doc: one head's Q, K, V (from the file, or projected from X) and
    its mask (causal; window, documents, prefix, sinks or a matrix — any mask is a mask mod on global
    positions). ``mask`` overrides the file's ``mask:`` key as ``qkv explain --mask`` does; ``layout`` None
    picks zigzag where the length allows (and the mask is causal), else contiguous. ValueError (one line, in
    ``lang``) when the example cannot run in a ring."""
    from qkv.explain import examples as ex
    P = int(world_size)
    if worked.start == "scores" or (worked.start == "QK" and worked.V is None):
        raise ValueError(t("ring.needs_qkv", lang))
    if worked.is_cross:
        raise ValueError(t("ring.cross", lang))
    used = [k_ for k_ in ("rope", "alibi", "softcap", "sink_logits") if getattr(worked, k_) is not None]
    if used:
        raise ValueError(t("ring.unsupported", lang, what=", ".join(used)))
    N = worked.n_queries
    _check_length(N, P, layout, lang)
    tr_ = ex.run(worked, heads=1, mask=mask)
    q, k, v = (np.asarray(tr_[x].array, dtype=np.float64) for x in ("Q", "K", "V"))
    scale = float(tr_["scaled"].params["scale"]) if "scaled" in tr_ else None
    m = worked.mask_matrix(mask)
    tokens = list(worked.tokens) if worked.tokens_given else None
    causal, mod, name = False, None, None
    if isinstance(m, str) and m == "causal":
        causal = True
    elif m is not None:
        mod, name = _matrix_mod(np.asarray(m, dtype=bool)), _mask_words(worked, lang)
    lay = layout or _choose_layout(N, P, causal)
    tr = trace_ring(q, k, v, P, is_causal=causal, layout=lay, mask_mod=mod, mask_name=name, scale=scale)
    doc = build_doc(tr, lang, precision, tokens)
    if worked.title:
        doc.intro.insert(0, worked.title)
    return doc


def _matrix_mod(given: np.ndarray):
    from qkv.core import mods

    def matrix_mask(b, h, q_idx, kv_idx):
        return given[q_idx, kv_idx]
    return mods.MaskMod(matrix_mask, name="matrix")


def _mask_words(worked, lang: str) -> str:
    parts = []
    if worked.window is not None:
        parts.append(t("ring.w_window", lang, n=worked.window))
    if worked.documents is not None:
        parts.append(t("ring.w_documents", lang))
    if worked.prefix is not None:
        parts.append(t("ring.w_prefix", lang, n=worked.prefix))
    if worked.sinks is not None:
        parts.append(t("ring.w_sinks", lang, n=worked.sinks))
    return " + ".join(parts) if parts else t("ring.matrix", lang)


def _choose_layout(N: int, P: int, causal: bool) -> str:
    """zigzag where it divides (and balances causal work), else contiguous."""
    if _layout.length_error(N, P, "zigzag") is None and (causal or _layout.length_error(N, P, "contiguous")):
        return "zigzag"
    return "contiguous" if _layout.length_error(N, P, "contiguous") is None else "zigzag"


def _check_length(N: int, P: int, layout, lang: str) -> None:
    lays = [layout] if layout else list(_layout.LAYOUTS)
    if all(_layout.length_error(N, P, lay) for lay in lays):
        k = _layout.units(P, lays[-1] if layout else "contiguous")
        raise ValueError(t("ring.length", lang, P=P, N=N, k=k))
