"""Mask families for the differential matrix's coverage (issue 39, item 4): which inputs each path was walked with.

A path walked is not a path proven: the compiled tile loop was walked by the matrix for rounds, but never with
packed documents whose boundaries fall inside its cells at the sizes where it runs, and it was wrong there. So
``tests/unit/test_matrix.py`` counts the engine's paths (:mod:`qkv.paths`) per **mask family** of the problem that
took them, and requires every (path, family) pair the path supports (:func:`supported`) — the compiled loops'
pairs at ``max(L, S) ≥ LARGE`` (:data:`LARGE_PATHS`), and their layout families (:data:`LAYOUT_FAMILIES`) with a
layout that has boundaries inside cells and many distinct tiles (:func:`layout`).

* :func:`family` — a :class:`qkv.accuracy.Spec`'s mask family, from its ``mask`` and ``mask_mod`` choices.
* :func:`recast` — a problem with another family's masks (the explicit problems of the matrix, each aimed at
  a path, recast to every family: :func:`every_family`).
* :func:`supported` — which families a path takes (:data:`SUPPORT`, from the engine's rules: see each comment).
* :func:`layout`, :func:`credited` — the distinct partial tiles of a problem's mask; whether a run counts.
* :func:`table` — the path × family table of what was walked, as text.
"""
from __future__ import annotations

import numpy as np

from qkv import accuracy as A

#: The families, in the table's order (each a column).
FAMILIES = ("none", "causal", "causal bottom-right", "sliding window", "prefix LM", "sinks", "StreamingLLM",
            "documents", "documents per batch", "and", "or", "custom mask mod", "bool attn_mask", "float attn_mask",
            "causal & mask mod", "attn_mask & mask mod")
#: Short column heads for the printed table.
SHORT = dict(zip(FAMILIES, ("none", "caus", "c-br", "win", "pfx", "sink", "strm", "doc", "docB", "and", "or",
                            "cust", "bool", "flt", "c&mm", "m&mm")))
_MOD_FAMILY = {"none": None, "causal": "causal", "sliding_window": "sliding window", "prefix_lm": "prefix LM",
               "sinks": "sinks", "streaming": "StreamingLLM", "document": "documents", "document_lengths": "documents",
               "document_batch": "documents per batch", "and": "and", "or": "or", "custom": "custom mask mod",
               "custom_rows": "custom mask mod", "custom_head": "custom mask mod", "custom_tiles": "custom mask mod"}
_MASK_FAMILY = {"none": None, "causal": "causal", "causal_bottom_right": "causal bottom-right",
                "bool": "bool attn_mask", "float": "float attn_mask"}
#: The block-mask families (a mask mod through create_block_mask, no attn_mask).
MOD_FAMILIES = FAMILIES[1:2] + FAMILIES[3:12]
#: …whose layout — where the cells' boundaries fall — decides how the tile loop cuts its pieces.
LAYOUT_FAMILIES = ("documents", "documents per batch", "and", "custom mask mod")
#: The sizes at which the compiled loops run on the engine's own limits (a task of max(L, S) ≥ 513 spans
#: several of its 512-key blocks, 64-row bands and 32-cells): their pairs count only from such problems.
LARGE = 513
#: The compiled loops and their kernels: a pair of theirs counts only at max(L, S) ≥ LARGE.
LARGE_PATHS = ("forward.plain_loop", "forward.plain_loop_lazy", "forward.mod_loop", "forward.tile_loop",
               "forward.tile_loop.strips", "backward.plain_loop", "kernel.plain_rows", "kernel.plain_rows.tiles",
               "kernel.plain_lazy_rows", "kernel.mod_rows", "kernel.plain_backward_rows")
#: A layout family's pair of a LARGE_PATHS path counts only from a layout with boundaries inside cells and at
#: least this many distinct partial tiles (:func:`layout`).
MIN_TILES = 8


def family(spec: A.Spec) -> str:
    """The mask family of ``spec``: its mask mod's (documents by ids or by lengths alike; per batch where it
    has a batch axis), or its ``mask``'s (``is_causal`` and a causal mask mod are both "causal"), or both's."""
    mod = _MOD_FAMILY[spec.mask_mod]
    if mod == "documents per batch" and len(spec.lead) != 2:
        mod = "documents"                                   # (no batch axis: one row of ids, as "document")
    mask = _MASK_FAMILY[spec.mask]
    if mod is None:
        return mask or "none"
    if mask is None:
        return mod
    return "causal & mask mod" if mask == "causal" else "attn_mask & mask mod"


_MOD_ARGS = (4, 9, 20)                                      # no degenerate mask: one document, no sinks, window 1
_SDPA = ("sdpa", "engine")                                  # the APIs that take an attn_mask / is_causal
_FLEX = ("flex", "engine")                                  # …and a block mask


# ============================================================================================ what is supported
#: The compiled loops of plain scores (no score mod, no mask but ``is_causal``'s, no block mask) and the
#: Python loop's base-2 pass of the same blocks; grouped heads in one task likewise (no mask, mod or sinks).
_PLAIN = ("forward.plain_loop", "forward.plain_loop_lazy", "backward.plain_loop", "kernel.plain_rows",
          "kernel.plain_lazy_rows", "kernel.plain_backward_rows", "forward.grouped_heads", "kernel.exp_rows.base2")
#: The compiled loop of ALiBi and softcaps: no mask, no block mask (ALiBi under ``is_causal`` too).
_MODS = ("forward.mod_loop", "kernel.mod_rows")
#: The compiled tile loop: a block mask, no attn_mask (``is_causal`` is a bit of its grid).
_TILES = ("forward.tile_loop", "kernel.plain_rows.tiles")
#: …its strips: the families whose block masks have cells that are bands in i − j (a window's edges, a causal
#: diagonal; custom ones: ``custom_head``'s ``j ≤ i + 2h``, ``custom_tiles``'s diagonal) — documents alone are
#: squares, sinks columns.
_BAND_FAMILIES = ("causal", "sliding window", "prefix LM", "StreamingLLM", "and", "or", "custom mask mod",
                  "causal & mask mod")
#: No block mask: split-K (a block mask's tasks take the tile loop) and the row shares of few heads.
_NO_BLOCK_MASK = ("none", "causal", "causal bottom-right", "bool attn_mask", "float attn_mask")
#: Block masks' mods that depend on i − j alone (causal, sliding_window): partial cells by a cached pattern,
#: runs of bands batched; the others' partial cells by calling the mod.
_INVARIANT = ("causal", "sliding window", "causal & mask mod", "attn_mask & mask mod")
_CALLED = FAMILIES[4:12] + ("causal & mask mod", "attn_mask & mask mod")
#: The paths whose work does not see the mask's layout — a score mod on a block, a block's fused exponential,
#: a task's query or key preparation, its output's division: required walked, with any family.
ANY = ("kernel.exp_rows.exp", "kernel.exp_rows.poly", "kernel.exp_rows.tanh", "kernel.max_exp_rows",
       "kernel.ds_rows", "kernel.q_prep", "kernel.kt_prep", "kernel.finish_rows", "score.alibi",
       "score.alibi_pattern", "score.generic", "score.softcap_poly", "score.softcap_tanh")
#: Path → the families it takes; every registered path must be here (a new path declares its families).
SUPPORT = {
    **dict.fromkeys(_PLAIN + _MODS, ("none", "causal")),
    **dict.fromkeys(_TILES, MOD_FAMILIES + ("causal & mask mod",)),
    "forward.tile_loop.strips": _BAND_FAMILIES,
    **dict.fromkeys(("forward.split_k", "forward.row_shares"), _NO_BLOCK_MASK),
    # ALiBi is shift-free (its column term folded into V) only under masks within the causal triangle
    "forward.alibi_fold": ("causal", "sliding window", "and", "causal & mask mod"),
    # a float mask may add any bias: never provably bounded
    "forward.shift_free": tuple(f for f in FAMILIES if f != "float attn_mask"),
    **dict.fromkeys(("forward.bands", "kernel.pattern_exp_rows"), ("sliding window",)),
    "mask.causal": ("causal",),                             # is_causal's diagonal blocks (with a block mask: its grid)
    "mask.attn_mask": ("causal bottom-right", "bool attn_mask", "float attn_mask", "attn_mask & mask mod"),
    "mask.pattern": _INVARIANT,
    "mask.mask_mod": _CALLED,
    **dict.fromkeys(("forward.lazy", "forward.max_pass", "forward.numpy_block", "forward.sinks", "forward.weights",
                     "forward.dropout", "backward.blocks", "backward.fused_exp", "backward.mod_grad",
                     "backward.mod_vjp", "backward.sinks"), FAMILIES),
    **dict.fromkeys(ANY, ()),
}


def supported(path: str):
    """The families ``path`` must be walked with (empty for :data:`ANY`'s paths: any one will do; None for a
    path not declared in :data:`SUPPORT`)."""
    return SUPPORT.get(path)


def layout(p) -> int:
    """The distinct partial tiles of problem ``p``'s mask (:class:`qkv.accuracy.Problem`'s ``allowed``) on cells of
    ``min(BLOCK_SIZE, 32)`` (the engine's cells of a block mask whose kinds it knows): 0 where every cell is
    full or empty — boundaries on the cells' edges."""
    if p.allowed is None:
        return 0
    L, S, c = p.spec.L, p.spec.S, min(p.spec.block_size, 32)
    a = np.broadcast_to(p.allowed, p.lead + (L, S)).reshape(-1, L, S)
    pad = np.zeros((a.shape[0], -(-L // c) * c, -(-S // c) * c), bool)
    pad[:, :L, :S] = a
    cells = pad.reshape(a.shape[0], pad.shape[1] // c, c, pad.shape[2] // c, c).transpose(0, 1, 3, 2, 4)
    cells = cells.reshape(-1, c * c)
    n = cells.sum(axis=1)
    partial = cells[(n > 0) & (n < c * c)]
    return 0 if partial.size == 0 else len(np.unique(np.packbits(partial, axis=1), axis=0))


def credited(path: str, fam: str, spec: A.Spec, tiles: int) -> bool:
    """Whether a run of ``path`` by ``spec`` (of family ``fam``, ``tiles`` distinct partial tiles) counts for the
    pair: a compiled loop's only at ``max(L, S) ≥ LARGE``, with a layout family's mask only where its cells'
    boundaries fall inside them, :data:`MIN_TILES` distinct tiles at least."""
    if path not in LARGE_PATHS:
        return True
    return max(spec.L, spec.S) >= LARGE and (fam not in LAYOUT_FAMILIES or tiles >= MIN_TILES)


def table(seen: dict, paths_: list) -> str:
    """``seen[(path, family)]`` (runs) as a path × family table: the count where walked, ``-`` where the path
    does not take the family, ``MISSING`` where it does and was not walked."""
    heads = [SHORT[f] for f in FAMILIES]
    width = max(len(p) for p in paths_)
    lines = [" " * width + " " + " ".join(f"{h:>5}" for h in heads)]
    for p in paths_:
        sup = supported(p)
        cells = []
        if sup is None:
            sup = FAMILIES
        elif not sup:
            sup = tuple(f for f in FAMILIES if seen.get((p, f)))
        for f in FAMILIES:
            n = seen.get((p, f), 0)
            cells.append(f"{n:>5}" if n else ("  -  " if f not in sup else " MISS"))
        lines.append(f"{p:<{width}} " + " ".join(cells))
    lines.append("columns: " + ", ".join(f"{SHORT[f]} = {f}" for f in FAMILIES))
    return "\n".join(lines)


# ==================================================================================== problems of each family
_RECAST_MODS = {"causal": ("causal",), "sliding window": ("sliding_window",), "prefix LM": ("prefix_lm",),
                "sinks": ("sinks",), "StreamingLLM": ("streaming",), "documents": ("document", "document_lengths"),
                "documents per batch": ("document_batch",), "and": ("and",), "or": ("or",),
                "custom mask mod": ("custom", "custom_rows", "custom_head", "custom_tiles")}
_RECAST_MASKS = {"causal": "causal", "causal bottom-right": "causal_bottom_right", "bool attn_mask": "bool",
                 "float attn_mask": "float"}


def recast(spec: A.Spec, fam: str, i: int = 0) -> A.Spec:
    """``spec`` with the masks of family ``fam`` instead of its own (the ``i``-th of the family's ways: causal by
    ``is_causal`` or by a mask mod, documents by ids or lengths, the custom mask mods), on an API that takes
    them (the backend object's where the spec's own does not)."""
    mask, mod = "none", "none"
    if fam == "causal":
        mask, mod = ("causal", "none") if i % 2 == 0 else ("none", "causal")
    elif fam in _RECAST_MASKS:
        mask = _RECAST_MASKS[fam]
    elif fam in _RECAST_MODS:
        mod = _RECAST_MODS[fam][i % len(_RECAST_MODS[fam])]
    elif fam != "none":
        mods = A.MASK_MODS[1:]
        mod = mods[i % len(mods)]
        mask = "causal" if fam == "causal & mask mod" else ("causal_bottom_right", "bool", "float")[i % 3]
    kw = dict(mask=mask, mask_mod=mod, mod_arg=spec.mod_arg if spec.mod_arg in _MOD_ARGS else _MOD_ARGS[0])
    if mod == "document_batch" and len(spec.lead) != 2:
        kw["lead"] = (2, spec.lead[-1] if spec.lead else 2)
        kw["kv_heads"] = spec.kv_heads if spec.lead else 0
        kw["kv_batch_one"] = False
    takes_mask, takes_mod = spec.api in _SDPA, spec.api in _FLEX
    if (mask != "none" and not takes_mask) or (mod != "none" and not takes_mod):
        kw.update(api="engine", route="tiled" if spec.route == "default" else spec.route)
    out = A.Spec(**{**spec.__dict__, **kw})
    assert family(out) == fam, (fam, out)
    return out


def every_family(specs) -> list:
    """Each of ``specs`` recast to every family (:func:`recast`; ``i`` its place in the list; causal both ways)."""
    out = []
    for i, s in enumerate(specs):
        out += [recast(s, fam, i) for fam in FAMILIES]
        out.append(recast(s, "causal", i + 1))
    return out
