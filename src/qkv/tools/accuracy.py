"""Accuracy against one float64 reference: the problems of the differential matrix, and how far each path is off.

Every way qkv can compute attention — the backends (``None``/auto, ``"reference"``, ``"tiled"``), the engine's
block kernels (NumPy's passes or numba's), the GEMM provider (NumPy's BLAS or MKL), one or two worker threads,
and every strategy of the tiled engine (the compiled loops, shift-free and lazy blocks, bands, split-K, …,
reached on small problems by moving its thresholds with :func:`qkv.backends.tiled.limits`) — must compute the
same function. This module says what that function is, once, in plain float64 NumPy (:func:`reference`), and
draws the problems to hold every path to it:

* :class:`Spec` — one problem and the route it takes: a plain, hashable record of choices (dtype, leading
  dims, grouped-query heads, L ≠ S, masks, mask mods and score mods, sinks, dropout, block sizes, the
  engine's limits, backend, kernels, GEMM, threads). :func:`draw_spec` makes one from any chooser
  ``choose(name, options) -> option``: a seeded NumPy generator (:func:`numpy_chooser`, for ``qkv bench
  --accuracy``) or hypothesis (``tests/unit/test_matrix.py``, which then shrinks each choice towards its first,
  simplest option).
* :func:`build` — the arrays and mods of a spec (:class:`Problem`); :func:`run` — what the path computes
  (output, lse, weights, gradients), with the spec's kernels, GEMM and limits set for the call and restored
  after; :func:`reference` — the float64 answer with the magnitudes the tolerances are scaled by.
* :func:`check` — every quantity's error against its tolerance (:func:`tolerance`); with dropout, the
  consistency checks (:func:`dropout_errors`): the tiled engine and the reference draw different random
  streams, so a dropped path is held to its own returned weights.

The reference is written from the spec alone (its mask mods and score mods as formulas, not through
:mod:`qkv.mods`), so a bug in a mod is a difference too; ``tests/integration/test_matrix_torch.py`` holds it to torch's float64
autograd.
"""
from __future__ import annotations

import types

import contextlib
import dataclasses
import math

import numpy as np

__all__ = ["Spec", "Problem", "draw_spec", "numpy_chooser", "build", "reference", "run", "check", "tolerance",
           "relative_errors", "dropout_errors", "configured", "VARIANTS", "DTYPES"]

DTYPES = ("float32", "float64", "float16")
ROUTES = ("default", "tiled", "reference")          # backend None (auto), "tiled", "reference"
APIS = ("flex", "sdpa", "engine")                    # the public functions, or the backend object itself
MASKS = ("none", "causal", "causal_bottom_right", "bool", "float")
MASK_MODS = ("none", "causal", "sliding_window", "prefix_lm", "sinks", "streaming", "document",
             "document_lengths", "document_batch", "and", "or", "custom", "custom_rows", "custom_head", "custom_tiles")
SCORE_MODS = ("none", "alibi", "softcap", "alibi_softcap", "custom_grad", "custom", "custom_inf", "custom_vjp")
#: The feature axes: in a variant's spec (:data:`VARIANTS`) those it does not name take their first option.
FEATURES = ("api", "masked", "mask", "mask_modded", "mask_mod", "score_modded", "score_mod", "sinks", "dropped",
            "dropout", "weights", "gqa")
#: The variants of the accuracy table, each a spec's features (the rest drawn: dtype, sizes, leading dims, …).
VARIANTS = types.MappingProxyType({
    "plain": dict(api="sdpa"), "causal": dict(api="sdpa", mask="causal"),
    "causal bottom-right": dict(api="sdpa", mask="causal_bottom_right"), "bool mask": dict(api="sdpa", mask="bool"),
    "float bias": dict(api="sdpa", mask="float"), "gqa": dict(api="sdpa", gqa=True),
    "alibi": dict(api="flex", score_mod="alibi"), "softcap": dict(api="flex", score_mod="softcap"),
    "alibi+softcap": dict(api="flex", score_mod="alibi_softcap"),
    "custom score mod": dict(api="flex", score_mod="custom_grad"), "window": dict(api="flex", mask_mod="sliding_window"),
    "document": dict(api="flex", mask_mod="document"), "prefix lm": dict(api="flex", mask_mod="prefix_lm"),
    "streaming": dict(api="flex", mask_mod="streaming"), "custom mask mod": dict(api="flex", mask_mod="custom"),
    "sinks": dict(api="flex", sinks=True),
})
#: The limits of backend=None's size rule: 0 makes it take the tiled engine on small inputs.
AUTO_LIMITS = ("auto_tiled_min_scores", "auto_tiled_min_head_scores", "auto_min_keys")


# ============================================================================================== custom mods
# Module-level functions (a readable repr in a falsifying example); written with operators and ufuncs, so that
# they take the reference's whole index arrays and the engine's blocks alike.
def custom_mask(b, h, q_idx, kv_idx):
    """A mask mod qkv knows nothing of: every third offset hidden."""
    return (q_idx - kv_idx) % 3 != 1


def custom_rows_mask(b, h, q_idx, kv_idx):
    """Causal, with rows 3, 8, 13, … that may attend to nothing."""
    return (q_idx >= kv_idx) & (q_idx % 5 != 3)


def custom_head_mask(b, h, q_idx, kv_idx):
    """A mask that depends on the head: query i sees keys up to i + 2h."""
    return kv_idx <= q_idx + 2 * h


def custom_tiles_mask(b, h, q_idx, kv_idx):
    """Causal, less the rectangles of 24 queries × 40 keys whose ranks sum to 0 modulo 3 (but the diagonal):
    full, empty and partial cells, the partial ones of many distinct patterns (the edges off every power of 2)."""
    return (q_idx >= kv_idx) & (((q_idx // 24 + kv_idx // 40) % 3 != 0) | (q_idx == kv_idx))


def custom_score(score, b, h, q_idx, kv_idx):
    """A score mod without a derivative (forward only; the backward must refuse it)."""
    return score - 0.02 * np.abs(q_idx - kv_idx) + 0.1 * h


def where_score(score, b, h, q_idx, kv_idx):
    return np.where(kv_idx > q_idx, score * 0.5, score + 0.1 * h)


def where_grad(score, b, h, q_idx, kv_idx):
    return np.where(kv_idx > q_idx, 0.5, 1.0)


def where_vjp(score, b, h, q_idx, kv_idx, grad_score):
    """``where_score``'s vector-Jacobian product (the backward's ``vjp`` path)."""
    return grad_score * np.where(kv_idx > q_idx, 0.5, 1.0)


def inf_score(score, b, h, q_idx, kv_idx):
    """A score mod that removes keys (−inf), as torch's may."""
    return np.where((q_idx - kv_idx) % 4 == 3, -np.inf, score * 1.25)


def inf_grad(score, b, h, q_idx, kv_idx):
    return np.full((), 1.25)


# ==================================================================================================== specs
@dataclasses.dataclass(frozen=True)
class Spec:
    """One problem of the matrix and the route it takes (see the module doc). Arrays come from ``seed``."""
    route: str = "tiled"
    api: str = "flex"
    kernels: str = "numba"
    gemm: str = "numpy"
    threads: int = 1
    dtype: str = "float32"
    lead: tuple = ()
    kv_heads: int = 0                    # 0: as many as the query's (no grouped-query heads)
    kv_batch_one: bool = False           # key/value batch 1, broadcast over the query's
    L: int = 8
    S: int = 8
    E: int = 8
    Ev: int = 8
    amp: float = 1.0                     # the standard deviation of q and k (large: the lazy paths)
    scale: float | None = None
    mask: str = "none"
    mask_full: bool = False              # the mask's shape: (L, S), or the scores' whole shape
    mask_mod: str = "none"
    mod_arg: int = 4                     # window, prefix, sinks, documents of the mask mod
    block_size: int = 16                 # create_block_mask's BLOCK_SIZE
    score_mod: str = "none"
    cap: float = 20.0
    sinks: bool = False
    dropout: float = 0.0
    weights: bool = False
    block_q: int | None = None           # tiled.forward/backward's block_q/block_k (api "engine")
    block_k: int | None = None
    limits: tuple = ()                   # ((name, value), …) for qkv.backends.tiled.limits
    seed: int = 0

    @property
    def backward(self) -> bool:
        """Whether the gradients are asked for (not with dropout: no backward takes it)."""
        return self.dropout == 0


def numpy_chooser(rng: np.random.Generator):
    """A chooser for :func:`draw_spec` from a NumPy generator: each option equally likely."""
    return lambda name, options: options[int(rng.integers(len(options)))]


def _available(kind: str) -> tuple:
    if kind == "gemm":
        from qkv.compute import gemm
        return tuple(gemm.GEMM.available())
    from importlib.util import find_spec
    return ("numba", "numpy") if find_spec("numba") is not None else ("numpy",)


def draw_spec(choose, variant: str | None = None) -> Spec:
    """A :class:`Spec` from ``choose(name, options) -> one of options`` (each axis's first option is its
    simplest). ``variant`` (a key of :data:`VARIANTS`): its features, every other feature off."""
    forced = {} if variant is None else dict(VARIANTS[variant])
    for gate, name in (("masked", "mask"), ("mask_modded", "mask_mod"), ("score_modded", "score_mod")):
        if name in forced:
            forced[gate] = True

    def pick(name, options):
        if name in forced:
            return forced[name]
        if variant is not None and name in FEATURES:
            return options[0]
        return choose(name, options)

    route = pick("route", ROUTES)
    api = pick("api", APIS if route != "default" else APIS[:2])
    run = dict(route=route, api=api, kernels=pick("kernels", _available("kernels")),
               gemm=pick("gemm", _available("gemm")), threads=pick("threads", (1, 2)),
               dtype=pick("dtype", DTYPES))
    shape = _draw_shape(pick)
    feats = _draw_features(pick, api)
    limits = _draw_limits(pick)
    blocks = {}
    if api == "engine" and route == "tiled":
        blocks = dict(block_q=pick("block_q", (None, 8, 16, 5, 32)), block_k=pick("block_k", (None, 8, 16, 6, 32)))
    return Spec(**run, **shape, **feats, **blocks, limits=limits, seed=pick("seed", tuple(range(64))))


def _draw_shape(pick) -> dict:
    gqa = pick("gqa", (False, True))
    n_lead = pick("lead", (1, 2) if gqa else (1, 0, 2))                 # grouped heads need a head axis
    kv_heads = pick("kv_heads", (1, 2)) if gqa else 0
    H = kv_heads * pick("group", (2, 3)) if gqa else (pick("heads", (2, 1, 3)) if n_lead else 1)
    lead = () if n_lead == 0 else (H,) if n_lead == 1 else (pick("batch", (2, 1)), H)
    L = pick("L", (8, 1, 5, 16, 23, 40, 64, 100, 130))
    S = pick("S", (None, 1, 6, 16, 29, 48, 72, 129)) or L
    E = pick("E", (8, 1, 4, 16, 32))
    return dict(lead=lead, kv_heads=kv_heads, kv_batch_one=n_lead == 2 and lead[0] > 1 and pick("kv_batch_one",
                (False, True)), L=L, S=S, E=E, Ev=pick("Ev", (None, 3, 16)) or E,
                amp=pick("amp", (1.0, 0.3, 3.0)), scale=pick("scale", (None, 0.5, 1.5)))


def _draw_features(pick, api) -> dict:
    """The masks, mods, sinks and dropout an API takes; each behind a gate that is off first (and two times in
    three for sinks, dropout and weights), so that plain problems — the compiled loops' — stay common."""
    f = dict(mask="none", mask_full=False, mask_mod="none", mod_arg=4, block_size=16, score_mod="none", cap=20.0,
             sinks=False, dropout=0.0, weights=False)
    if api in ("sdpa", "engine"):
        if pick("masked", (False, True)):
            f["mask"] = pick("mask", MASKS[1:])
        if f["mask"] in ("bool", "float"):
            f["mask_full"] = pick("mask_full", (False, True))
        if pick("dropped", (False, False, True)):
            f["dropout"] = pick("dropout", (0.25, 0.6, 1.0))
        f["weights"] = f["dropout"] > 0 or pick("weights", (False, False, True))
    if api in ("flex", "engine"):
        if pick("mask_modded", (False, True)):
            f["mask_mod"] = pick("mask_mod", MASK_MODS[1:])
            f["mod_arg"] = pick("mod_arg", (4, 1, 9, 0, 20))
            f["block_size"] = pick("block_size", (16, 8, 4, 32, 128))
        if pick("score_modded", (False, True)):
            f["score_mod"] = pick("score_mod", SCORE_MODS[1:])
        if "softcap" in f["score_mod"]:
            f["cap"] = pick("cap", (20.0, 1.0, 0.5, 50.0))
        f["sinks"] = pick("sinks", (False, False, True))
    return f


#: The engine's limits the matrix moves, each with its options (the first: the matrix's usual setting).
LIMIT_OPTIONS = types.MappingProxyType({
    "block_q": (16, 8, 32, 5, 64), "block_k": (16, 8, 32, 6, 64),
    "block_q_plain": (16, 32, 8, 2048), "block_k_plain": (16, 8, 32, 256),
    "block_q_backward": (16, 8, 32, 7, 512), "block_k_backward": (16, 8, 32, 5, 512),
    "kernel_min": (0, 64, 1 << 14), "serial_below_flops": (0, 1 << 23),
    "diagonal_min": (8, 4, 16, 256), "diagonal_min_plain": (8, 4, 32),
    "plain_loop": (True, False), "tile_loop": (True, False), "group_gqa": (True, False),
    "shift_free_bound": (30.0, 0.0), "lazy_bound": (40.0, 0.5),
    "grid_call_cost": (0.75, 0.0, 8.0), "grid_call_cost_backward": (2.0, 0.0),
    "band_group_scores": (1 << 20, 256), "grid_cell": (64, 8, 16), "grid_cell_backward": (64, 8, 16),
    "band_rows_plain": (8, 64, 2), "band_keys_plain": (16, 128, 4), "block_q_tiles": (64, 16, 4096),
    "strip_rows_tiles": (16, 3, 64),
    "split_k_min_blocks": (2, 1), "split_k_min_part_keys": (8, 1 << 16),
})


def _draw_limits(pick) -> tuple:
    lim = {name: pick(name, options) for name, options in LIMIT_OPTIONS.items()}
    if pick("auto_moved", (True, False)):               # backend=None takes the tiled engine on small inputs
        lim.update(dict.fromkeys(AUTO_LIMITS, 0))
    return tuple(sorted(lim.items()))


# ================================================================================================= problems
@dataclasses.dataclass
class Problem:
    """A spec's arrays and mods, as the public functions take them, and what the reference needs."""
    spec: Spec
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    grad_out: np.ndarray
    scale: float                          # the scale actually used (1/√E when the spec's is None)
    enable_gqa: bool = False
    rep: int = 1                          # query heads per key/value head
    is_causal: bool = False
    attn_mask: np.ndarray | None = None
    score_mod: object = None
    block_mask: object = None
    sink_logits: np.ndarray | None = None
    allowed: np.ndarray | None = None     # the reference's mask: bool, broadcastable to lead + (L, S)
    bias: np.ndarray | None = None        # the reference's additive float mask
    ref_mod: tuple | None = None          # (fn, grad) in float64 for the reference

    @property
    def lead(self) -> tuple:
        return tuple(self.q.shape[:-2])


def build(spec: Spec) -> Problem:
    """The arrays (seeded by ``spec.seed``), masks and mods of ``spec``."""
    r = np.random.default_rng(spec.seed)
    dt = np.dtype(spec.dtype)
    lead, L, S = spec.lead, spec.L, spec.S
    kv_lead = lead
    if spec.kv_heads:
        kv_lead = lead[:-1] + (spec.kv_heads,)
    if spec.kv_batch_one:
        kv_lead = (1,) + kv_lead[1:]
    q = (r.standard_normal(lead + (L, spec.E)) * spec.amp).astype(dt)
    k = (r.standard_normal(kv_lead + (S, spec.E)) * spec.amp).astype(dt)
    v = r.standard_normal(kv_lead + (S, spec.Ev)).astype(dt)
    go = r.standard_normal(lead + (L, spec.Ev)).astype(dt)
    p = Problem(spec, q, k, v, go, scale=1 / math.sqrt(spec.E) if spec.scale is None else float(spec.scale),
                enable_gqa=bool(spec.kv_heads), rep=(lead[-1] // spec.kv_heads) if spec.kv_heads else 1)
    _build_mask(p, r)
    _build_mask_mod(p, r)
    _build_score_mod(p)
    if spec.sinks:
        p.sink_logits = (r.standard_normal(lead[-1] if lead else 1) * 2).astype(dt)
    return p


def _and(a, b):
    return b if a is None else a & b


def _build_mask(p: Problem, r) -> None:
    spec, L, S = p.spec, p.spec.L, p.spec.S
    shape = (spec.lead if spec.mask_full else ()) + (L, S)
    if spec.mask == "causal":
        p.is_causal = True
        p.allowed = np.arange(S)[None, :] <= np.arange(L)[:, None]
    elif spec.mask == "causal_bottom_right":
        from qkv.core import masks
        p.attn_mask = masks.causal(L, S, align="bottom-right")
        p.allowed = np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)
    elif spec.mask == "bool":
        p.attn_mask = p.allowed = r.random(shape) < 0.7
    elif spec.mask == "float":
        bias = r.standard_normal(shape) * 2
        bias[r.random(shape) < 0.15] = -np.inf
        p.attn_mask = p.bias = bias.astype(spec.dtype)


def _doc_ids(spec: Spec, r, rows=None) -> np.ndarray:
    n = max(spec.L, spec.S)
    ids = r.integers(0, max(1, spec.mod_arg), (n,) if rows is None else (rows, n))
    return ids if spec.mod_arg % 2 else np.sort(ids, axis=-1)        # sorted ids, or (odd counts) not


def _mask_mod(spec: Spec, r):
    """The qkv mask mod of the spec, the reference's formula ``(b, h, i, j) -> bool``, and the B, H to build
    its block mask for (None: broadcast)."""
    from qkv.core import mods
    a, B, H = spec.mod_arg, None, None
    window = max(1, a)
    name = spec.mask_mod
    if name in ("document", "document_lengths", "document_batch", "and"):
        if name == "document_batch" and len(spec.lead) == 2:
            B = spec.lead[0]
            ids = _doc_ids(spec, r, rows=B)
            return mods.document(ids), lambda b, h, i, j: ids[b, i] == ids[b, j], B, H
        if name == "document_lengths":
            n = max(spec.L, spec.S)
            cuts = np.sort(r.choice(np.arange(1, n), size=min(max(a, 1), n) - 1, replace=False)) if n > 1 else []
            lengths = np.diff(np.concatenate([[0], cuts, [n]])).astype(np.int64)
            ids = np.repeat(np.arange(lengths.size), lengths)
            mod = mods.document_from_lengths(lengths)
        else:
            ids = _doc_ids(spec, r)
            mod = mods.document(ids)
        if name == "and":
            return mods.and_masks(mods.causal(), mod), lambda b, h, i, j: (i >= j) & (ids[i] == ids[j]), B, H
        return mod, lambda b, h, i, j: ids[i] == ids[j], B, H
    if name == "custom_head" and spec.lead:
        H = spec.lead[-1]
    table = {
        "causal": (lambda: mods.causal(), lambda b, h, i, j: i >= j),
        "sliding_window": (lambda: mods.sliding_window(window), lambda b, h, i, j: (i - j >= 0) & (i - j < window)),
        "prefix_lm": (lambda: mods.prefix_lm(a), lambda b, h, i, j: (j < a) | (i >= j)),
        "sinks": (lambda: mods.sinks(a), lambda b, h, i, j: (j < a) & (i >= 0)),
        "streaming": (lambda: mods.or_masks(mods.sinks(a), mods.sliding_window(window)),
                      lambda b, h, i, j: (j < a) | ((i - j >= 0) & (i - j < window))),
        "or": (lambda: mods.or_masks(mods.prefix_lm(a), mods.sliding_window(window)),
               lambda b, h, i, j: (j < a) | (i >= j) | ((i - j >= 0) & (i - j < window))),
        "custom": (lambda: custom_mask, custom_mask),
        "custom_rows": (lambda: custom_rows_mask, custom_rows_mask),
        "custom_head": (lambda: custom_head_mask, custom_head_mask),
        "custom_tiles": (lambda: custom_tiles_mask, custom_tiles_mask),
    }
    make, formula = table[name]
    return make(), formula, B, H


def _build_mask_mod(p: Problem, r) -> None:
    spec = p.spec
    if spec.mask_mod == "none":
        return
    from qkv.core.blockmask import create_block_mask
    mod, formula, B, H = _mask_mod(spec, r)
    p.block_mask = create_block_mask(mod, B, H, spec.L, spec.S, BLOCK_SIZE=spec.block_size)
    b, h, i, j = _indices(p.lead, spec.L, spec.S)
    allowed = formula(b if B is not None else np.zeros((), np.int64), h if H is not None else np.zeros((), np.int64),
                      i, j)
    p.allowed = _and(p.allowed, np.asarray(allowed, dtype=bool))


def _build_score_mod(p: Problem) -> None:
    from qkv.core import mods
    spec = p.spec
    name = spec.score_mod
    if name == "none":
        return
    H = p.lead[-1] if p.lead else 1
    slopes = mods.alibi_slopes(H) * np.where(np.arange(H) % 3 == 2, -1.0, 1.0)   # a negative slope too
    cap = spec.cap

    def bias(h, i, j):
        return slopes[h] * (j - i)

    table = {
        "alibi": (lambda: mods.alibi(slopes), lambda s, b, h, i, j: s + bias(h, i, j),
                  lambda s, b, h, i, j: np.ones(())),
        "softcap": (lambda: mods.softcap(cap), lambda s, b, h, i, j: cap * np.tanh(s / cap),
                    lambda s, b, h, i, j: 1 - np.tanh(s / cap) ** 2),
        "alibi_softcap": (lambda: mods.compose(mods.alibi(slopes), mods.softcap(cap)),
                          lambda s, b, h, i, j: cap * np.tanh((s + bias(h, i, j)) / cap),
                          lambda s, b, h, i, j: 1 - np.tanh((s + bias(h, i, j)) / cap) ** 2),
        "custom": (lambda: custom_score, custom_score, None),
        "custom_grad": (lambda: mods.ScoreMod(where_score, grad=where_grad), where_score, where_grad),
        "custom_inf": (lambda: mods.ScoreMod(inf_score, grad=inf_grad), inf_score, inf_grad),
        "custom_vjp": (lambda: mods.ScoreMod(where_score, vjp=where_vjp), where_score, where_grad),
    }
    make, fn, grad = table[name]
    p.score_mod, p.ref_mod = make(), (fn, grad)


def _indices(lead: tuple, L: int, S: int):
    """``b``, ``h``, ``q_idx``, ``kv_idx`` broadcastable to lead + (L, S): b the batch index, h the head."""
    zero = np.zeros((), np.int64)
    b = np.arange(lead[0], dtype=np.int64).reshape(-1, 1, 1, 1) if len(lead) == 2 else zero
    h = np.arange(lead[-1], dtype=np.int64).reshape(-1, 1, 1) if lead else zero
    return b, h, np.arange(L, dtype=np.int64)[:, None], np.arange(S, dtype=np.int64)[None, :]


# ================================================================================================ reference
def _expand(x: np.ndarray, lead: tuple, rep: int) -> np.ndarray:
    """Key/value (kv_lead, T, ·) as the query's heads: grouped heads repeated, a batch of 1 broadcast."""
    if rep > 1:
        x = np.repeat(x, rep, axis=-3)
    return np.broadcast_to(x, lead + x.shape[-2:])


def _reduce(x: np.ndarray, kv_shape: tuple, rep: int) -> np.ndarray:
    """The inverse of :func:`_expand` for gradients: grouped heads and a broadcast batch summed."""
    if rep > 1:
        x = x.reshape(x.shape[:-3] + (x.shape[-3] // rep, rep) + x.shape[-2:]).sum(axis=-3)
    if x.shape != kv_shape:
        x = x.sum(axis=0, keepdims=True)
    return x


def reference(p: Problem) -> dict:
    """The float64 answer of ``p`` in plain NumPy, and the magnitudes its errors are measured against.

    ``s = Q·Kᵀ·scale`` → the score mod (its formula) → the additive float mask → the mask (−inf) → softmax over
    ``[s, sink_h]`` (the sink a column with no value; a row with nothing allowed and no sink: weights 0, lse −inf)
    → ``out = P·V``, ``lse = log Σ exp``. Gradients: ``dV = Pᵀ·dO``, ``dP = dO·Vᵀ``, ``D = rowsum(dO ∘ out)``,
    ``dS = P ∘ (dP − D) ∘ mod′(s)``, ``dQ = dS·K·scale``, ``dK = dSᵀ·Q·scale``, ``d sink_h = −Σ P_sink·D``;
    grouped heads and broadcast batches summed.

    Returns a dict: ``out``, ``lse``, ``weights``, ``dq``, ``dk``, ``dv``, ``dsink`` (None without sinks or
    without a derivative), ``max_score`` (the largest |score| allowed, before and after the mod), and ``mag``:
    per quantity the largest element of the same formula on absolute values (``P·|V|``, ``Pᵀ·|dO|``,
    ``P ∘ (|dO|·|V|ᵀ + rowsum(|dO| ∘ |out|)) ∘ max(|mod′|, 1)`` through ``|K|``, ``|Q|``, ``Σ P_sink·rowsum(|dO| ∘
    |out|)``) — what rounding errors scale with.
    """
    spec, lead, rep = p.spec, p.lead, p.rep
    L, S = spec.L, spec.S
    q = p.q.astype(np.float64)
    k, v = (_expand(x.astype(np.float64), lead, rep) for x in (p.k, p.v))
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * p.scale                    # lead + (L, S)
    b, h, i, j = _indices(lead, L, S)
    sm, g = s, None
    if p.ref_mod is not None:
        fn, grad = p.ref_mod
        sm = np.broadcast_to(np.asarray(fn(s, b, h, i, j), np.float64), s.shape)
        g = None if grad is None else np.broadcast_to(np.asarray(grad(s, b, h, i, j), np.float64), s.shape)
    if p.bias is not None:
        sm = sm + p.bias.astype(np.float64)
    if p.allowed is not None:
        sm = np.where(p.allowed, sm, -np.inf)
    sm = np.broadcast_to(sm, lead + (L, S))
    sink = None
    if p.sink_logits is not None:
        sk = p.sink_logits.astype(np.float64)
        sink = np.broadcast_to(sk.reshape(-1, 1, 1) if lead else sk.reshape(1, 1), lead + (L, 1))
    m = sm.max(axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(sm - m)
    es = None if sink is None else np.exp(sink - m)
    total = e.sum(axis=-1, keepdims=True) + (0.0 if es is None else es)
    live = total > 0
    P = np.where(live, e / np.where(live, total, 1.0), 0.0)
    lse = np.where(live, m + np.log(np.where(live, total, 1.0)), -np.inf)[..., 0]
    out = P @ v
    finite = np.isfinite(sm)
    ref = dict(out=out, lse=lse, weights=P, max_score=float(max(np.abs(np.where(finite, s, 0)).max(initial=0),
                                                                np.abs(np.where(finite, sm, 0)).max(initial=0))))
    ref["mag"] = dict(out=float((P @ np.abs(v)).max(initial=0)), lse=max(1.0, float(np.abs(lse[np.isfinite(lse)])
                                                                                     .max(initial=0))),
                      weights=float(P.max(initial=0)))
    _reference_backward(p, ref, q, k, v, P, es, total, g)
    return ref


def _reference_backward(p: Problem, ref: dict, q, k, v, P, es, total, g) -> None:
    """The gradients (and their magnitudes) into ``ref``; None where the spec's mod has no derivative."""
    spec = p.spec
    ref.update(dq=None, dk=None, dv=None, dsink=None)
    if not spec.backward or (p.ref_mod is not None and p.ref_mod[1] is None):
        return
    dO = p.grad_out.astype(np.float64)
    out = ref["out"]
    D = np.sum(dO * out, axis=-1, keepdims=True)                            # lead + (L, 1)
    mD = np.sum(np.abs(dO) * np.abs(out), axis=-1, keepdims=True)          # D's own scale (it cancels)
    dS = P * (dO @ np.swapaxes(v, -1, -2) - D)
    mS = P * (np.abs(dO) @ np.swapaxes(np.abs(v), -1, -2) + mD)
    if g is not None:                       # the derivative's own rounding is absolute (softcap's 1 − tanh²)
        dS, mS = dS * g, mS * np.maximum(np.abs(g), 1.0)
    Pt = np.swapaxes(P, -1, -2)
    ref["dq"] = dS @ k * p.scale
    ref["dk"] = _reduce(np.swapaxes(dS, -1, -2) @ q * p.scale, p.k.shape, p.rep)
    ref["dv"] = _reduce(Pt @ dO, p.v.shape, p.rep)
    mag = ref["mag"]
    mag["dq"] = float((mS @ np.abs(k)).max(initial=0) * abs(p.scale))
    mag["dk"] = float(_reduce(np.swapaxes(mS, -1, -2) @ np.abs(q), p.k.shape, p.rep).max(initial=0) * abs(p.scale))
    mag["dv"] = float(_reduce(Pt @ np.abs(dO), p.v.shape, p.rep).max(initial=0))
    if es is not None:
        live = total > 0
        p_sink = np.where(live, es / np.where(live, total, 1.0), 0.0)      # lead + (L, 1)
        H = p.sink_logits.shape[0]
        ref["dsink"] = -(p_sink * D)[..., 0].reshape(-1, H, spec.L).sum(axis=(0, 2))
        mag["dsink"] = float((p_sink * mD)[..., 0].reshape(-1, H, spec.L).sum(axis=(0, 2)).max(initial=0))


# ====================================================================================================== run
@contextlib.contextmanager
def configured(spec: Spec):
    """The spec's block kernels, GEMM provider and engine limits for the calls inside (one
    :func:`qkv.config` block: nothing of the process rewritten); where ``backend=None`` is to take the tiled
    engine on small inputs, the backward's size rule too (``backward_whole_scores`` 0)."""
    from qkv.engine.backends.configuration import config
    lim = dict(spec.limits)
    if lim.get("auto_tiled_min_scores") == 0:
        lim.setdefault("backward_whole_scores", 0)
    with config(gemm=spec.gemm, kernels=spec.kernels, limits=lim):
        yield


def _backend(spec: Spec):
    return None if spec.route == "default" else spec.route


def _forward(p: Problem, rng=None) -> dict:
    """One forward call of the spec's API: ``{"out", "lse", "weights"}``."""
    from qkv.engine import backends
    from qkv.engine.flex import flex_attention
    from qkv.engine.sdpa import scaled_dot_product_attention
    spec = p.spec
    if spec.api == "flex":
        out, lse = flex_attention(p.q, p.k, p.v, p.score_mod, p.block_mask, spec.scale, p.enable_gqa,
                                  return_lse=True, sink_logits=p.sink_logits, backend=_backend(spec),
                                  threads=spec.threads)
        return dict(out=out, lse=lse, weights=None)
    if spec.api == "sdpa":
        res = scaled_dot_product_attention(p.q, p.k, p.v, p.attn_mask, spec.dropout, p.is_causal, spec.scale,
                                           p.enable_gqa, return_weights=spec.weights, rng=rng,
                                           backend=_backend(spec), return_lse=True, threads=spec.threads)
        out, w, lse = res if spec.weights else (res[0], None, res[1])
        return dict(out=out, lse=lse, weights=w)
    extra = dict(block_q=spec.block_q, block_k=spec.block_k) if spec.route == "tiled" else {}
    out, w, lse = backends.get(spec.route).forward(
        p.q, p.k, p.v, attn_mask=p.attn_mask, dropout_p=spec.dropout, is_causal=p.is_causal, scale=p.scale,
        enable_gqa=p.enable_gqa, rng=rng, return_weights=spec.weights, return_lse=True, threads=spec.threads,
        score_mod=p.score_mod, block_mask=p.block_mask, sink_logits=p.sink_logits, **extra)
    return dict(out=out, lse=lse, weights=w)


def _backward(p: Problem) -> tuple:
    """The spec's backward: ``(dq, dk, dv[, dsink])``. The sdpa API's public backward has no backend
    argument: ``backend=None`` runs it, a named backend runs that backend's ``backward``."""
    from qkv.engine import backends
    from qkv.engine.api import scaled_dot_product_attention_backward
    from qkv.engine.flex import flex_attention_backward
    spec = p.spec
    if spec.api == "flex":
        return flex_attention_backward(p.grad_out, p.q, p.k, p.v, p.score_mod, p.block_mask, spec.scale,
                                       p.enable_gqa, sink_logits=p.sink_logits, backend=_backend(spec),
                                       threads=spec.threads)
    if spec.api == "sdpa" and spec.route == "default":
        return scaled_dot_product_attention_backward(p.grad_out, p.q, p.k, p.v, p.attn_mask, p.is_causal,
                                                     spec.scale, p.enable_gqa)
    extra = dict(block_q=spec.block_q, block_k=spec.block_k) if spec.route == "tiled" and spec.api == "engine" else {}
    return backends.get(spec.route).backward(
        p.grad_out, p.q, p.k, p.v, attn_mask=p.attn_mask, is_causal=p.is_causal, scale=p.scale,
        enable_gqa=p.enable_gqa, threads=spec.threads, score_mod=p.score_mod, block_mask=p.block_mask,
        sink_logits=p.sink_logits, **extra)


def run(p: Problem, *, backward: bool = True) -> dict:
    """What the spec's path computes: ``out``, ``lse``, ``weights`` (or None), ``dq``, ``dk``, ``dv``, ``dsink``
    (None when not asked for), ``backward_error`` (the exception a backward refused with, e.g. a score mod
    without a derivative), and with dropout ``again`` (the forward once more with the same seed)."""
    spec = p.spec
    got = dict(dq=None, dk=None, dv=None, dsink=None, backward_error=None, again=None)
    with configured(spec):
        seed = spec.seed + 1000
        got.update(_forward(p, np.random.default_rng(seed) if spec.dropout else None))
        if spec.dropout:
            got["again"] = _forward(p, np.random.default_rng(seed))
        if backward and spec.backward:
            try:
                grads = _backward(p)
            except ValueError as e:
                got["backward_error"] = e
            else:
                got.update(dq=grads[0], dk=grads[1], dv=grads[2], dsink=grads[3] if len(grads) > 3 else None)
    return got


# =================================================================================================== errors
#: Per dtype ``(a, b)``: a quantity's error, over its magnitude, may be ``a + b·max|score|``. float32: its
#: rounding of each score (≈ 4 units of 2⁻²⁴ of the largest) and 2e-5 for the rest; float16 (computed in float32,
#: rounded to float16 at the end): float16's unit roundoff twice (2⁻¹⁰) on top; float64 likewise, far tighter.
TOLERANCES = types.MappingProxyType(
    {"float64": (1e-12, 4e-15), "float32": (2e-5, 2.4e-7), "float16": (2 ** -10 + 2e-5, 2.4e-7)})
QUANTITIES = ("out", "lse", "weights", "dq", "dk", "dv", "dsink")


def tolerance(spec: Spec, ref: dict) -> float:
    """The largest error allowed for ``spec`` (relative to each quantity's magnitude, see :func:`check`)."""
    a, b = TOLERANCES[spec.dtype]
    return a + b * ref["max_score"]


def _diff(got, want) -> float:
    """max |got − want| (float64), inf where the shapes differ or where one is ±inf and the other not."""
    g = np.asarray(got, np.float64)
    w = np.asarray(want, np.float64)
    if g.shape != w.shape:
        return math.inf
    fin = np.isfinite(w)
    if not np.array_equal(fin, np.isfinite(g)) or not np.array_equal(g[~fin], w[~fin]):
        return math.inf
    return float(np.abs(g[fin] - w[fin]).max(initial=0.0))


def check(p: Problem, got: dict, ref: dict) -> list:
    """The failures of one run: ``[(quantity, error, tolerance), …]``, empty when everything is within tolerance.

    Each quantity's error is ``max|got − ref| / magnitude``, the magnitude from :func:`reference` (``mag``: the
    same formula on absolute values — for the output ``max(P·|V|)``, for dV ``max(Pᵀ·|dO|)`` — so that
    cancellation in the reference does not inflate it; ``lse`` over ``max(1, max|lse|)``; ±inf must match
    exactly), after the dtype's smallest subnormal (a float16 result of 1e-7 is a multiple of 6e-8). A backward that refused must have refused a score mod without a derivative, and vice versa.
    """
    tol = tolerance(p.spec, ref)
    floor = float(np.finfo(p.spec.dtype).smallest_subnormal)     # float16's results round to 6e-8 at least
    bad = []
    for name in QUANTITIES:
        if name in ("out", "weights") and p.spec.dropout:
            continue                                          # dropped weights: dropout_errors
        g, w = got.get(name), ref.get(name)
        if w is None or (name == "weights" and g is None):
            continue
        if g is None:
            bad.append((name, math.inf, tol))
            continue
        err = max(_diff(g, w) - floor, 0.0) / max(ref["mag"][name], np.finfo(np.float64).tiny)
        if not err <= tol:
            bad.append((name, err, tol))
    refused = got.get("backward_error") is not None
    wants_refusal = p.spec.backward and p.ref_mod is not None and p.ref_mod[1] is None
    if refused != wants_refusal:
        bad.append(("backward_error", got.get("backward_error"), "a ValueError for a mod without grad"))
    if p.spec.dropout:
        bad += [(name, err, tol) for name, err in dropout_errors(p, got, ref).items() if not err <= tol]
    return bad


def dropout_errors(p: Problem, got: dict, ref: dict) -> dict:
    """Dropout, checked by consistency (the engine and the reference draw different random streams):

    * ``out = W·V`` with ``W`` the returned (dropped, rescaled) weights (error over ``max(|W|·|V|)``);
    * every kept weight (``W ≠ 0``) equals the reference probability / (1 − p) (error over the largest such
      probability), every other is 0 by construction;
    * the same seed gives the same output and weights, bit for bit (error 0 or inf).
    """
    drop = p.spec.dropout
    floor = float(np.finfo(p.spec.dtype).smallest_subnormal)     # as check(): results round to it at least
    tiny = np.finfo(np.float64).tiny
    W = np.asarray(got["weights"], np.float64)
    v = _expand(p.v.astype(np.float64), p.lead, p.rep)
    wv = W @ v
    errs = {"dropout out = W·V": max(_diff(got["out"], wv) - floor, 0.0)
            / max(float((np.abs(W) @ np.abs(v)).max(initial=0)), tiny)}
    want = ref["weights"] * (0.0 if drop >= 1 else 1.0 / (1.0 - drop))
    kept = W != 0
    errs["dropout kept = P/(1-p)"] = (max(float(np.abs(W - want)[kept].max(initial=0.0)) - floor, 0.0)
                                      / max(float(want.max(initial=0)), tiny))
    again = got["again"]
    same = (np.array_equal(again["out"], got["out"], equal_nan=True)
            and np.array_equal(again["weights"], got["weights"], equal_nan=True))
    errs["dropout same seed, same output"] = 0.0 if same else math.inf
    return errs


def relative_errors(got: dict, ref: dict, names) -> float:
    """The accuracy table's error of one case, normwise over the quantities ``names`` taken together:
    ``max|got − ref| / max|ref|``, both over every element of them all (so a gradient that is 0 by structure —
    dQ with one key per row — does not divide its rounding noise by its own). Where the reference is all 0: the
    largest |got|."""
    diff = scale = 0.0
    for name in names:
        w = ref.get(name)
        if w is None or got.get(name) is None:
            continue
        diff = max(diff, _diff(got[name], w))
        scale = max(scale, float(np.abs(np.asarray(w, np.float64)[np.isfinite(w)]).max(initial=0)))
    return diff / scale if scale > 0 else diff
