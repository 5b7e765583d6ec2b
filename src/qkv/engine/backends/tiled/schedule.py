"""The plan as data: what a tiled call will do, made by the code the call runs, before anything is computed.

:func:`forward_plan` and :func:`backward_plan` set a call up exactly as :func:`qkv.backends.tiled.backend.forward`
and :func:`~qkv.backends.tiled.backend.backward` do (the same :class:`~qkv.backends.tiled.plan._Problem`, the
same block sizes, task rows, split-K and worker count, and per task the same
:class:`~qkv.backends.tiled.forward_pass._Task` and the first of its ``STRATEGIES`` that supports it), and
describe it as frozen dataclasses: a :class:`Plan` of :class:`TaskPlan` s, each with its strategy, the reason it
was chosen and its :class:`Piece` s in the order they run. The run takes its strategy from the same function
(:func:`~qkv.backends.tiled.forward_pass._strategy`), so what the plan says is what runs;
:mod:`qkv.backends.tiled.proof` checks a plan against the mask without running attention.

A piece's semantics are the kernels' (:func:`qkv.compute._jit.plain_rows`, :func:`qkv.compute._jit.plain_backward_rows`, the
Python loop's :class:`~qkv.backends.tiled.scoring._Scorer`): rows ``r0 … r1`` of the task's query block (positions
× ``group``: row ``r`` is position ``i0 + r // group`` of head ``idx[-1] + r % group``), keys ``j0 … j1``; within
it, key ``j0 + c`` is kept for block row ``r`` where ``lower + r // group ≤ c ≤ upper + r // group`` (None:
no edge) and ``tiles[tile][tile_row + r // group, c]`` is 1, and what ``masks`` names is applied exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from qkv.core import shapes
from qkv.compute.kernels import NO_LO, NO_MASK
from qkv.engine.backends.runtime import RUNTIME
from qkv.engine.backends.tiled import backward_pass as _bp, forward_pass as _fp
from qkv.engine.backends.tiled.bands import _band_groups
from qkv.engine.backends.tiled.plan import _Problem, _first_rows, _plain_backward_plan
from qkv.engine.backends.tiled.setup import backward_setup, forward_setup


@dataclass(frozen=True, eq=False)
class Piece:
    """One block a task computes (see the module doc for the kernels' semantics).

    ``masks``: what the block applies exactly, beyond its edges and tile — None (nothing), ``"causal"`` (top-left:
    key j for position i where j ≤ i), ``"attn_mask"`` (the mask's slice), ``("grid", ops)`` (a block mask's
    runs of cells, ops ``(i0, i1, j0, j1, bits)`` in positions and keys: bits −1 empty, 1 the mask mod, 2
    causal, 4 the attn_mask) or ``("pattern", array)`` (a band's additive 0/−inf pattern, (rows, keys)).
    ``fresh``: True where the block writes the rows' state, False where it adds to it, None where the strategy
    keeps a running max and rescales (its own bookkeeping)."""
    rows: tuple
    keys: tuple
    upper: int | None = None
    lower: int | None = None
    tile: int | None = None
    tile_row: int = 0
    masks: object = None
    fresh: bool | None = None
    head: int = 0


@dataclass(frozen=True, eq=False)
class TaskPlan:
    """One task: the forward's query rows ``rows`` (positions) of head ``head`` and the ``group − 1`` heads after it
    (only key blocks starting in ``keys`` under split-K), or the backward's keys ``keys`` of key/value head
    ``head`` against ``heads``' rows; its ``strategy``, the ``reason`` it was chosen and its ``pieces`` in the
    order they run (the backward's: per query head of ``heads``, rows absolute positions). ``tiles`` (T, rows,
    keys) the 0/1 tiles its pieces name. A backward piece's ``head`` is its query head's place in ``heads``."""
    head: tuple
    rows: tuple
    keys: tuple | None
    group: int
    strategy: str
    reason: str
    pieces: tuple
    tiles: np.ndarray | None = None
    heads: tuple = ()

    def computed(self) -> int:
        """Scores its pieces compute (rows × keys)."""
        return sum((p.rows[1] - p.rows[0]) * (p.keys[1] - p.keys[0]) for p in self.pieces)

    def __str__(self) -> str:
        from qkv.engine.backends.tiled.plan_text import render_pieces
        return render_pieces(self)


@dataclass(frozen=True, eq=False)
class Plan:
    """A whole call: ``backend`` and why, the shapes, the block sizes, split-K's parts, the workers, the tasks."""
    direction: str
    backend: str
    reason: str
    lead: tuple
    L: int
    S: int
    block_q: int = 0
    block_k: int = 0
    split_k: int = 1
    workers: int = 1
    causal: bool = False
    tasks: tuple = ()
    problem: object = field(default=None, repr=False)

    def computed(self) -> int:
        """Scores the pieces compute (rows × keys, all heads)."""
        return sum(t.computed() for t in self.tasks)

    def work_fraction(self) -> float:
        """The share of all L·S scores of every head that the plan computes."""
        full = math.prod(self.lead) * self.L * self.S
        return self.computed() / full if full else 0.0

    def strategies(self) -> dict:
        """How many tasks take each strategy."""
        got: dict = {}
        for t in self.tasks:
            got[t.strategy] = got.get(t.strategy, 0) + 1
        return got

    def __str__(self) -> str:
        from qkv.engine.backends.tiled.plan_text import render
        return render(self)


# ---------------------------------------------------------------------------------------------- forward
def forward_plan(query, key, value, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale, enable_gqa=False,
                 return_weights=False, threads=None, block_q=None, block_k=None, score_mod=None, block_mask=None,
                 sink_logits=None, reason: str = "named") -> Plan:
    """The plan of :func:`qkv.backends.tiled.backend.forward` with these arguments (validated arrays)."""
    threads = RUNTIME.resolve_threads(threads)
    P = _Problem(query, key, value, attn_mask, is_causal, scale, enable_gqa, score_mod, block_mask, sink_logits)
    setup = forward_setup(P, block_q, block_k, threads, dropout_p, return_weights)
    return forward_plan_of(setup, dropout_p, return_weights, reason)


def forward_plan_of(setup, dropout_p: float = 0.0, return_weights: bool = False, reason: str = "named") -> Plan:
    """The plan of a forward cut by ``setup`` (:func:`qkv.backends.tiled.setup.forward_setup`, its problem as cut):
    each part's task built as the run builds it."""
    P = setup.problem
    weights = np.zeros(0) if return_weights else None          # (_Task asks only whether there are weights)
    tasks = []
    for idx, i0, i1, keys in setup.parts:
        with _fp._SETUP:
            T = _fp._Task(P, idx, i0, i1, setup.bk, weights, dropout_p, 0, keys)
        tasks.append(task_plan(P, T))
    return Plan("forward", "tiled", reason, P.lead, P.L, P.S, setup.bq, setup.bk, setup.splits, setup.threads,
                P.is_causal, tuple(tasks), P)


def task_plan(P, T) -> TaskPlan:
    """A built forward task (:class:`~qkv.backends.tiled.forward_pass._Task`) as data: the strategy the run takes,
    why, and its pieces."""
    st = _fp._strategy(P, T)
    pieces, tiles = _pieces(P, T, st.name)
    return TaskPlan(T.idx, (T.i0, T.i1), T.keys, T.g, st.name, _fp.strategy_reason(P, T, st.name), tuple(pieces),
                    tiles)


def _pieces(P, T, name: str):
    """The task's pieces as its strategy runs them."""
    if name == "compiled loop, tiles":
        return [_loop_piece(row, True, True) for row in T.loop_plan], T.tiles[1]
    if name.startswith("compiled loop"):
        return [_loop_piece(row, name != "compiled loop, lazy", False) for row in T.loop_plan], None
    added: list = []
    out = []
    if name == "batched bands":
        slope = T.sc.slope if T.sc.kind in ("alibi", "alibi_softcap") else None
        for step in _band_groups(P, T.blocks, T.i0, slope, P.limits.band_group_scores):
            if step[0] == "bands":
                out += _band_pieces(T, step, added)
            else:
                out.append(_block_piece(T, step, _first_rows(added, step[0], step[1])))
        return out, None
    for step in T.blocks:
        fresh = _first_rows(added, step[0], step[1]) if name == "shift-free blocks" else None
        out.append(_block_piece(T, step, fresh))
    return out, None


def _loop_piece(row, fresh_column: bool, tiled: bool) -> Piece:
    """A compiled loop's plan row ``(r0, r1, j0, j1, d, fresh[, tile, lo, t0])``."""
    r0, r1, j0, j1, d, fresh = (int(x) for x in row[:6])
    tile = int(row[6]) if tiled and row[6] >= 0 else None
    lo = int(row[7]) if tiled and row[7] != NO_LO else None
    return Piece((r0, r1), (j0, j1), None if d == NO_MASK else d, lo, tile, int(row[8]) if tiled else 0, None,
                 bool(fresh) if fresh_column else None)


def _block_piece(T, step, fresh) -> Piece:
    """A Python-loop block ``(r0, r1, j0, j1, kind)`` (positions from i0): its rows in the query block, the
    mask its kind applies (absolute positions)."""
    r0, r1, j0, j1, kind = step
    return Piece((r0 * T.g, r1 * T.g), (j0, j1), masks=_masks_of(kind), fresh=fresh)


def _masks_of(kind):
    """A block kind (:meth:`~qkv.backends.tiled.plan._Problem.key_blocks`) as a piece's ``masks``."""
    if kind == "full":
        return None
    if kind == "mask":
        return "attn_mask"
    if kind == "causal":
        return "causal"
    return ("grid", tuple(tuple(int(x) for x in op) for op in kind[1]))


def _band_pieces(T, step, added: list) -> list:
    """A run of bands: ``n`` blocks of ``h`` rows, each ``h`` keys on, one pattern (adds: the rows' state starts
    at 0, and the run's rows join ``added`` as :func:`~qkv.backends.tiled.forward_pass._bands` does)."""
    _, r0, n, h, j0, w, (bias, mask) = step
    kept = np.ones((h, w), bool)                               # (ALiBi without a cap carries the mask in its bias)
    for add in (bias, mask):
        if add is not None:
            kept &= np.isfinite(add)
    pat = None if kept.all() else ("pattern", kept)
    added.append((r0, r0 + n * h))
    return [Piece((r0 + b * h, r0 + (b + 1) * h), (j0 + b * h, j0 + b * h + w), masks=pat, fresh=None)
            for b in range(n)]


# ---------------------------------------------------------------------------------------------- backward
def backward_plan(query, key, value, *, attn_mask=None, is_causal=False, scale, enable_gqa=False, threads=None,
                  block_q=None, block_k=None, score_mod=None, block_mask=None, sink_logits=None,
                  reason: str = "named") -> Plan:
    """The plan of :func:`qkv.backends.tiled.backend.backward`'s key-block tasks (the forward it may run first
    has a plan of its own)."""
    threads = RUNTIME.resolve_threads(threads)
    P = _Problem(query, key, value, attn_mask, is_causal, scale, enable_gqa, score_mod, block_mask, sink_logits,
                 backward=True)
    return backward_plan_of(backward_setup(P, block_q, block_k, threads), reason)


def backward_plan_of(setup, reason: str = "named") -> Plan:
    """The backward plan cut by ``setup`` (:func:`qkv.backends.tiled.setup.backward_setup`, its problem as cut)."""
    P = setup.problem
    kv_lead = shapes.kv_lead(P.lead, P.n_rep)
    tasks = []
    for kv_idx in np.ndindex(*kv_lead):
        heads = tuple(shapes.query_heads(kv_idx, P.n_rep))
        for j0 in range(0, P.S, setup.bk):
            tasks.append(backward_task_plan(P, kv_idx, heads, j0, min(j0 + setup.bk, P.S), setup))
    return Plan("backward", "tiled", reason, P.lead, P.L, P.S, setup.bq, setup.bk, 1, setup.threads, P.is_causal,
                tuple(tasks), P)


def backward_task_plan(P, kv_idx, heads, j0: int, j1: int, setup) -> TaskPlan:
    """Keys j0 … j1 of one key/value head as :func:`~qkv.backends.tiled.backward_pass._backward_task` runs them:
    per query head, the compiled loop's blocks or the Python loop's."""
    plain = _bp.plain_supported(P, setup.bq, setup.bk)
    pieces = []
    for h, idx in enumerate(heads):
        if plain:
            for i0, i1, c0, c1, d in _plain_backward_plan(P, idx, j0, j1, setup.bq).tolist():
                pieces.append(Piece((i0, i1), (c0, c1), None if d == NO_MASK else d, head=h))
        else:
            for i0, i1, c0, c1, kind in P.backward_blocks(idx, j0, j1, setup.bq):
                pieces.append(Piece((i0, i1), (c0, c1), masks=_masks_of(kind), head=h))
    name = "compiled loop" if plain else "blocks"
    return TaskPlan(tuple(kv_idx), (0, P.L), (j0, j1), 1, name, _bp.strategy_reason(P, plain), tuple(pieces),
                    heads=heads)
