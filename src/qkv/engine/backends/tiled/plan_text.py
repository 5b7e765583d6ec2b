"""A plan as text: ``print(qkv.plan(...))`` — the call's cut, then a table of its tasks (strategy, pieces, tiles,
scores computed) with each distinct reason once, as a footnote."""
from __future__ import annotations

import math


def render(plan, limit: int = 40) -> str:
    """The plan's header and its first ``limit`` tasks as a table (every strategy's count and reason after)."""
    heads = math.prod(plan.lead)
    lines = [f"{plan.direction} plan · backend {plan.backend} ({plan.reason})",
             f"  heads {plan.lead or '()'} · L {plan.L:,} × S {plan.S:,}"
             + ("" if plan.direction == "backward" else f" · causal {'yes' if plan.causal else 'no'}")]
    if not plan.tasks:
        lines.append("  no tasks: this backend computes every head's scores at once (dense, no plan to show)")
        return "\n".join(lines)
    full = heads * plan.L * plan.S
    lines.append(f"  block_q {plan.block_q} · block_k {plan.block_k} · split-K {plan.split_k} · workers "
                 f"{plan.workers} · tasks {len(plan.tasks)}")
    lines.append(f"  work fraction {plan.work_fraction():.3f} ({plan.computed():,} of {full:,} scores computed)")
    notes: dict = {}
    rows = []
    for n, t in enumerate(plan.tasks[:limit]):
        mark = notes.setdefault((t.strategy, t.reason), "abcdefghijklmnopqrstuvwxyz"[len(notes) % 26])
        keys = "all" if t.keys is None else f"{t.keys[0]}…{t.keys[1]}"
        rows.append((str(n), str(t.head), f"{t.rows[0]}…{t.rows[1]}", keys, f"{t.strategy} [{mark}]",
                     str(len(t.pieces)), str(len({p.tile for p in t.pieces if p.tile is not None})),
                     f"{t.computed():,}"))
    head = ("task", "head" if plan.direction == "forward" else "kv head", "rows", "keys", "strategy", "pieces",
            "tiles", "scores")
    widths = [max(len(r[c]) for r in rows + [head]) for c in range(len(head))]
    lines.append("")
    for r in [head] + rows:
        lines.append("  " + "  ".join(x.rjust(w) if c in (0, 5, 6, 7) else x.ljust(w)
                                      for c, (x, w) in enumerate(zip(r, widths))).rstrip())
    if len(plan.tasks) > limit:
        lines.append(f"  … {len(plan.tasks) - limit} more tasks")
    lines.append("")
    for (strategy, reason), mark in notes.items():
        lines.append(f"  [{mark}] {strategy}: {reason}")
    counts = ", ".join(f"{s} ×{c}" for s, c in plan.strategies().items())
    lines.append(f"  strategies: {counts}")
    return "\n".join(lines)


def render_pieces(task, limit: int = 60) -> str:
    """A task's pieces as a table, in the order they run: rows, keys, edges, tile and its row origin, masks, fresh."""
    head = ("piece", "rows", "keys", "upper", "lower", "tile", "masks", "fresh")
    rows = []
    for n, p in enumerate(task.pieces[:limit]):
        masks = p.masks if isinstance(p.masks, str) or p.masks is None else p.masks[0]
        rows.append((str(n), f"{p.rows[0]}…{p.rows[1]}", f"{p.keys[0]}…{p.keys[1]}", _opt(p.upper), _opt(p.lower),
                     "-" if p.tile is None else f"{p.tile}@{p.tile_row}", _opt(masks),
                     {True: "write", False: "add", None: "rescaled"}[p.fresh]))
    widths = [max(len(r[c]) for r in rows + [head]) for c in range(len(head))]
    out = ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in [head] + rows]
    if len(task.pieces) > limit:
        out.append(f"… {len(task.pieces) - limit} more pieces")
    return "\n".join(out)


def _opt(x) -> str:
    return "-" if x is None else str(x)
