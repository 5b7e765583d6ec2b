"""A worked example's keyword arguments for :func:`qkv.pipeline.attend`: its mask (``mask:`` with window,
prefix, documents and sinks), score mods (ALiBi, soft-capping), sink logits and RoPE."""
from __future__ import annotations

import numpy as np

from qkv.explain._worked import Worked, _mask_mod


def _plain_d_k(d_k):
    """d_k as the formula shows it: an int when it is one."""
    if d_k is None:
        return None
    d = float(d_k)
    return int(d) if d.is_integer() else d


def _options(worked: Worked, m, L: int, S: int, h: int, q_range: tuple[int, int] | None = None) -> dict:
    """The keyword arguments of :func:`qkv.pipeline.attend` for this example: its mask (and where it came
    from), its score mods (ALiBi, soft-capping), sink logits and RoPE. ``m`` is the ``mask:`` key (or what
    ``run(mask=...)`` put in its place); window, prefix, documents and sinks combine with it.

    ``q_range=(r0, r1)``: for the query rows r0 … r1−1 only (:func:`run_rows`): the mask's rows r0 … r1−1, and
    score mods that see the true query index (``q_idx + r0``)."""
    from qkv.core import masks as _masks
    from qkv.core import mods, pipeline
    from qkv.core.positions import RoPE

    opts: dict = {}
    r0, r1 = (0, L) if q_range is None else q_range
    mod = _mask_mod(worked, m, L, S) if worked.has_mask_mods else None
    if mod is not None:
        lead = (1, h) if h > 1 or worked.sink_logits is not None else ()
        b, hh, q_idx, kv_idx = pipeline.indices(lead, r1 - r0, S, q_offset=r0)
        dense = mods.call_mask_mod(mod, b, hh, q_idx, kv_idx)                      # bool, broadcastable
        opts.update(mask=np.array(np.broadcast_to(dense, np.broadcast_shapes(dense.shape, (r1 - r0, S)))),
                    mask_source=mod)
    elif isinstance(m, str) and m == "causal":
        if q_range is None:
            opts.update(mask=_masks.causal(L, S), mask_source="causal")
        else:                                       # rows r0 … r1−1 of masks.causal(L, S) (top-left: j ≤ i)
            opts.update(mask=np.arange(S)[None, :] <= np.arange(r0, r1)[:, None], mask_source="causal")
    elif m is not None:
        opts.update(mask=m if q_range is None else np.asarray(m)[..., r0:r1, :], mask_source="attn_mask")
    score_mods = []
    if worked.alibi is not None:
        if worked.alibi is True:
            slopes = mods.alibi_slopes(h)
        else:
            slopes = np.asarray(worked.alibi, dtype=np.float64)
            if slopes.size != h:
                raise ValueError(f"heads: the example's alibi gives {slopes.size} slope(s), one per head; "
                                 f"expected {h} for {h} heads")
        score_mods.append(mods.alibi(slopes))
    if worked.softcap is not None:
        score_mods.append(mods.softcap(worked.softcap))
    if score_mods:
        opts["score_mod"] = score_mods[0] if len(score_mods) == 1 else mods.compose(*score_mods)
        if r0:
            opts["score_mod"] = _shifted(opts["score_mod"], r0)
    if worked.sink_logits is not None:
        if worked.sink_logits.size != h:
            raise ValueError(f"heads: the example's sink_logits give {worked.sink_logits.size} logit(s), one "
                             f"per head; expected {h} for {h} heads")
        opts["sink_logits"] = worked.sink_logits
    if worked.rope is not None:
        opts["rope"] = RoPE(theta=worked.rope["theta"], style=worked.rope["style"])
        q_pos = worked.positions if worked.positions is not None else np.arange(L, dtype=np.int64)
        if worked.kv_positions is not None:
            k_pos = worked.kv_positions
        elif not worked.is_cross:
            k_pos = q_pos
        else:
            k_pos = np.arange(S, dtype=np.int64)
        opts.update(q_positions=q_pos, k_positions=k_pos)
    return opts


def _shifted(mod, r0: int):
    """``mod`` seeing query indices shifted by ``r0`` (a block of rows r0 … computed on its own)."""
    from qkv.core import mods

    def fn(score, b, h, q_idx, kv_idx):
        return mod(score, b, h, q_idx + r0, kv_idx)
    return mods.ScoreMod(fn, name=mod.name, params=mod.params, records=mod.records, step_names=mod.step_names)

