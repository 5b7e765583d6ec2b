"""Runs of bands: a block mask's consecutive blocks masked alike relative to their corners (a sliding window's cell
rows), grouped to run as one batched computation (:func:`_band_groups`), with their shared additive pattern
(:func:`_band_pattern`: the mask, and ALiBi's bias, as functions of j − i)."""
from __future__ import annotations

import numpy as np

from qkv.engine.backends.runtime import RUNTIME
from qkv.engine.backends.tiled.scoring import _cached, _causal_additive, _mod_additive


def _band_groups(P, blocks: list, i0: int, slope, max_scores: int) -> list:
    """The blocks, with runs of *bands* merged: consecutive blocks of the same height h and width w, each
    h rows and h keys further on (a sliding window's cell rows), whose masking is the same relative to the
    block — empty cells, a mask mod that depends on i − j alone, the causal bit — so that one pattern
    (mask, and ALiBi's bias, also a function of j − i) serves them all. A run becomes ``("bands", r0, n, h,
    j0, w, pattern)`` and runs as one batched computation (strided views of Q, Kᵀ, V: no copies), where
    block by block the Python steps of a 128-row band cost a third of its time."""
    out, k, n_b = [], 0, len(blocks)
    inv = P.bm is not None and P.mask_traits.invariant
    while k < n_b:
        r0, r1, j0, j1, kind = blocks[k]
        h, w = r1 - r0, j1 - j0
        sig = _rel_ops(kind, i0 + r0, j0, inv)
        e = k + 1
        if sig is not None:
            while (e < n_b and (e - k + 1) * h * w <= max_scores):
                q0, q1, c0, c1, kd = blocks[e]
                if not (q1 - q0 == h and c1 - c0 == w and q0 == r0 + (e - k) * h and c0 == j0 + (e - k) * h
                        and _rel_ops(kd, i0 + q0, c0, inv) == sig):
                    break
                e += 1
        if e - k >= 2:
            out.append(("bands", r0, e - k, h, j0, w,
                        _band_pattern(P, sig, i0 + r0 - j0, h, w, slope, P.mod.cap is not None)))
        else:
            out.append(blocks[k])
        k = e
    return out


def _rel_ops(kind, a0: int, j0: int, inv: bool):
    """A block's masking relative to its corner, or None when it cannot be shared (attn_mask, a mod that
    is not a function of i − j)."""
    if kind == "full":
        return ()
    if isinstance(kind, str):
        return ("causal",) if kind == "causal" else None
    rel = []
    for o0, o1, c0, c1, v in kind[1]:
        if v > 0 and (v & 4 or (v & 1 and not inv)):
            return None
        rel.append((o0 - a0, o1 - a0, c0 - j0, c1 - j0, v))
    return tuple(rel)


def _band_pattern(P, sig: tuple, d: int, h: int, w: int, slope, split: bool):
    """The additive (h, w) patterns of a band at offset ``d = a0 − j0``: ``(bias, mask)`` — ALiBi's
    ``slope·(j − i)`` (float64, rounded once) and −inf where masked, each None when there is none; with
    ``split`` False (no softcap between them) added into one."""
    if not sig and slope is None:
        return None, None

    def build():
        mask = np.zeros((h, w), np.float64)
        if sig == ("causal",):
            mask += _causal_additive(d, h, w, np.float64)
        else:
            for r0, r1, c0, c1, v in sig:
                sub = mask[r0:r1, c0:c1]
                if v < 0:
                    sub[...] = -np.inf
                    continue
                if v & 1:
                    sub += _mod_additive(P.bm.mask_mod, d + r0 - c0, r1 - r0, c1 - c0, np.float64)
                if v & 2:
                    sub += _causal_additive(d + r0 - c0, r1 - r0, c1 - c0, np.float64)
        bias = None
        if slope is not None:
            bias = slope * (np.arange(w)[None, :] - np.arange(h)[:, None] - d).astype(np.float64)
        mask = np.ascontiguousarray(mask, dtype=P.cdt) if sig else None
        bias = None if bias is None else np.ascontiguousarray(bias, dtype=P.cdt)
        if not split and bias is not None and mask is not None:
            bias, mask = np.ascontiguousarray(bias + mask, dtype=P.cdt), None
        return mod, bias, mask
    mod = P.bm.mask_mod
    key = ("bands", id(mod), sig, d, h, w, slope, split, P.cdt.char)
    got = _cached(key, build)
    if got[0] is not mod:                                    # an id reused by a new mod: rebuild
        RUNTIME.patterns.drop(key)
        got = _cached(key, build)
    return got[1], got[2]
