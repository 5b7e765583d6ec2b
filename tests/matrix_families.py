"""Mask families for the differential matrix's coverage (issue 39, item 4): which inputs each path was walked with.

A path walked is not a path proven: the compiled tile loop was walked by the matrix for rounds, but never with
packed documents whose boundaries fall inside its cells at the sizes where it runs, and it was wrong there. So
``tests/test_matrix.py`` counts the engine's paths (:mod:`qkv.paths`) per **mask family** of the problem that
took them, and requires every (path, family) pair the path supports (:func:`supported`) — the compiled loops'
pairs at ``max(L, S) ≥ LARGE`` (:data:`LARGE_PATHS`), and their layout families (:data:`LAYOUT_FAMILIES`) with a
layout that has boundaries inside cells and many distinct tiles (:func:`layout`).

* :func:`family` — a :class:`qkv.accuracy.Spec`'s mask family, from its ``mask`` and ``mask_mod`` choices.
* :func:`forcing` — a chooser for :func:`qkv.accuracy.draw_spec` that draws problems of one family (the
  other choices left to the chooser it wraps).
* :func:`supported` — which families a path can take, from the engine's rules (see each rule's comment).
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


#: Per family, the draws that force it: (name → a value, or a tuple of options to choose from), one dict a way.
_MOD_ARGS = (4, 9, 20)                                      # no degenerate mask: one document, no sinks, window 1
_SDPA = ("sdpa", "engine")
_FLEX = ("flex", "engine")


def _mask_way(mask):
    return dict(api=_SDPA, masked=True, mask=mask, mask_modded=False)


def _mod_way(*mods, **extra):
    return dict(api=_FLEX, masked=False, mask_modded=True, mask_mod=mods, mod_arg=_MOD_ARGS, **extra)


FORCING = {
    "none": [dict(masked=False, mask_modded=False)],
    "causal": [_mask_way("causal"), _mod_way("causal")],
    "causal bottom-right": [_mask_way("causal_bottom_right")],
    "sliding window": [_mod_way("sliding_window")], "prefix LM": [_mod_way("prefix_lm")],
    "sinks": [_mod_way("sinks")], "StreamingLLM": [_mod_way("streaming")],
    "documents": [_mod_way("document", "document_lengths")],
    "documents per batch": [_mod_way("document_batch", gqa=False, lead=2, batch=2)],
    "and": [_mod_way("and")], "or": [_mod_way("or")],
    "custom mask mod": [_mod_way("custom", "custom_rows", "custom_head", "custom_tiles")],
    "bool attn_mask": [_mask_way("bool")], "float attn_mask": [_mask_way("float")],
    "causal & mask mod": [dict(_mod_way(*A.MASK_MODS[1:]), api="engine", route=("tiled", "reference"),
                               masked=True, mask="causal")],
    "attn_mask & mask mod": [dict(_mod_way(*A.MASK_MODS[1:]), api="engine", route=("tiled", "reference"),
                                  masked=True, mask=("causal_bottom_right", "bool", "float"))],
}


def forcing(fam: str, choose):
    """A chooser for :func:`qkv.accuracy.draw_spec` whose problems are of family ``fam``: the choices that
    decide the family forced (a tuple: ``choose`` picks among those of its options it allows), the rest
    ``choose``'s."""
    ways = FORCING[fam]
    way = ways[0] if len(ways) == 1 else ways[choose("family way", tuple(range(len(ways))))]

    def pick(name, options):
        want = way.get(name)
        if want is None:
            return choose(name, options)
        if not isinstance(want, tuple):
            return want
        allowed = tuple(o for o in options if o in want) or want
        return choose(name, allowed)

    return pick


def drawn(fam: str, seeds) -> list:
    """Problems of family ``fam`` drawn by :func:`qkv.accuracy.numpy_chooser` from each seed of ``seeds``."""
    out = []
    for seed in seeds:
        spec = A.draw_spec(forcing(fam, A.numpy_chooser(np.random.default_rng([seed, FAMILIES.index(fam)]))))
        assert family(spec) == fam, (fam, spec)
        out.append(spec)
    return out


# ============================================================================================ what is supported
#: The compiled loops of plain scores (no score mod, no mask but ``is_causal``'s, no block mask).
_PLAIN = ("forward.plain_loop", "forward.plain_loop_lazy", "backward.plain_loop", "kernel.plain_rows",
          "kernel.plain_lazy_rows", "kernel.plain_backward_rows", "forward.grouped_heads")
#: The compiled loop of ALiBi and softcaps: no mask, no block mask (ALiBi: with ``is_causal`` too).
_MODS = ("forward.mod_loop", "kernel.mod_rows")
#: The compiled tile loop: a block mask, no attn_mask (``is_causal`` is a bit of its grid).
_TILES = ("forward.tile_loop", "kernel.plain_rows.tiles")
#: The families whose block masks have cells that are bands in i − j (a window's edges, a causal diagonal):
#: the strips (custom ones: ``custom_head``'s ``j ≤ i + 2h``; documents alone are squares, their sinks columns).
_BAND_FAMILIES = ("causal", "sliding window", "prefix LM", "StreamingLLM", "and", "or", "custom mask mod",
                  "causal & mask mod")
#: Block-mask paths of the Python loop.
_BLOCK_MASK = ("mask.mask_mod", "mask.pattern", "forward.bands", "kernel.pattern_exp_rows")


def supported(path: str) -> tuple:
    """The families ``path`` can take (a subset of :data:`FAMILIES`)."""
    with_bm = MOD_FAMILIES + ("causal & mask mod", "attn_mask & mask mod")
    if path in _PLAIN:
        return ("none", "causal")
    if path in _MODS:
        return ("none", "causal")
    if path in _TILES:
        return MOD_FAMILIES + ("causal & mask mod",)
    if path == "forward.tile_loop.strips":
        return _BAND_FAMILIES
    if path == "mask.causal":                               # is_causal's diagonal blocks by NumPy
        return ("causal", "causal & mask mod")
    if path == "mask.attn_mask":
        return ("causal bottom-right", "bool attn_mask", "float attn_mask", "attn_mask & mask mod")
    if path in _BLOCK_MASK:
        return with_bm
    return FAMILIES


def table(seen: dict, paths_: list) -> str:
    """``seen[(path, family)]`` (runs) as a path × family table: the count where walked, ``-`` where the path
    does not take the family, ``MISSING`` where it does and was not walked."""
    heads = [SHORT[f] for f in FAMILIES]
    width = max(len(p) for p in paths_)
    lines = [" " * width + " " + " ".join(f"{h:>5}" for h in heads)]
    for p in paths_:
        sup = supported(p)
        cells = []
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
    """Each of ``specs`` recast to every family (:func:`recast`; ``i`` its place in the list)."""
    return [recast(s, fam, i) for i, s in enumerate(specs) for fam in FAMILIES]
