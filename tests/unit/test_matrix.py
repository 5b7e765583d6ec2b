"""The differential matrix (issue 25): every path qkv can take, against one float64 reference.

Problems (``qkv.accuracy.draw_spec``, here through hypothesis, which shrinks each choice towards its simplest
option) cover every axis: backend None / "reference" / "tiled" through ``qkv.flex_attention``,
``qkv.scaled_dot_product_attention`` and their backwards, or the backend object itself (``forward`` /
``backward``, with ``block_q``/``block_k`` for the tiled one); block kernels numba / numpy; GEMM numpy / mkl;
threads 1 / 2; float16/32/64; no leading dims, (H,), (B, H), grouped-query heads, a key/value batch of 1;
L ≠ S; ``is_causal`` (top-left) and ``masks.causal(align="bottom-right")``; bool masks and float biases of
shape (L, S) or the scores' whole shape; every built-in mask mod (causal, sliding_window, prefix_lm, sinks,
StreamingLLM, document, document_from_lengths, per-batch documents, and_masks, or_masks) and custom ones (a
plain callable, one with empty rows, one that depends on the head, one of many distinct tiles) through
``create_block_mask`` with BLOCK_SIZE 4…128; every built-in score mod (alibi with a negative slope too, softcap,
compose(alibi, softcap)) and custom ones (a plain callable — whose backward must be refused —, ``ScoreMod(fn, grad=…)``,
``ScoreMod(fn, vjp=…)``, one that returns −inf); sink logits; dropout; returned weights; and the engine's thresholds moved
(``qkv.backends.tiled.limits``: block sizes, ``kernel_min=0``, ``serial_below_flops=0``, the diagonal's
squares, the compiled loops on/off, shift-free and lazy bounds, the grid's cells and call costs, split-K's
keys, and ``backend=None``'s size rule) so that small problems straddle each of them.

**Tolerances** (``qkv.accuracy.check``): each quantity — output, lse, weights, dq, dk, dv, d sink_logits — is
compared as ``max|got − ref| / magnitude ≤ a + b·max|score|``, where max|score| is the largest allowed
|scaled score| before and after the score mod, and the magnitude is the reference's formula on absolute
values (output: max(P·|V|); dV: max(Pᵀ·|dO|); dQ, dK: P ∘ (|dO|·|V|ᵀ + |D|) ∘ max(|mod′|, 1) through |K|, |Q|
times |scale|, with |D| = rowsum(|dO| ∘ |out|); d sink: max_h Σ P_sink·|D|; lse: max(1, max|lse|); weights:
max P) — the scale rounding errors
grow with, which cancellation in the reference cannot shrink. ``(a, b)``: float32 (2e-5, 2.4e-7) (float32
rounds each score: 2.4e-7 ≈ 4 units of 2⁻²⁴ of the largest), float64 (1e-12, 4e-15), float16 (2⁻¹⁰ + 2e-5,
2.4e-7: computed in float32, rounded to float16, whose subnormal results are multiples of 6e-8, which is
allowed on top). ±inf (rows that may attend to nothing) must match exactly.

**Dropout** draws different random streams in the engine and the reference, so it is checked by consistency:
the output equals the returned (dropped, rescaled) weights · V, every kept weight equals the float64 reference
probability / (1 − p), and the same seed gives the same output and weights bit for bit.

**Coverage** (``test_the_matrix_walks_every_registered_path``): every registered path walked, and every path
with every mask family it takes (``tests/matrix_families.py``) — the compiled loops at L ≥ 513 on the engine's
own limits, documents and custom masks there with boundaries inside cells and many distinct tiles (``LARGE_PROBLEMS``);
``pytest -s`` or ``-rP`` prints the path × family table.

Budget: ``EXAMPLES`` (derandomized: CI is reproducible); ``QKV_MATRIX_EXAMPLES=2000`` runs that many, random.
A falsifying ``Spec(...)`` reproduces without hypothesis: ``p = qkv.accuracy.build(spec)``, then
``qkv.accuracy.check(p, qkv.accuracy.run(p), qkv.accuracy.reference(p))`` lists what is off.
"""
import os
from collections import Counter

import matrix_families as MF
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkv import accuracy as A
from qkv import paths

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow

EXAMPLES = 800


@pytest.fixture(autouse=True)
def _plans_proven(monkeypatch):
    """Every plan the matrix runs is proven against its mask first (``QKV_CHECK_PLANS=1``, issue 39): a plan bug
    fails as a ``PlanError`` naming the scores, before any number is compared."""
    monkeypatch.setenv("QKV_CHECK_PLANS", "1")
_ENV = int(os.environ.get("QKV_MATRIX_EXAMPLES", "0") or 0)


@st.composite
def specs(draw):
    """A problem and its route: every choice of :func:`qkv.accuracy.draw_spec` drawn by hypothesis."""
    return A.draw_spec(lambda name, options: draw(st.sampled_from(options), label=name))


def _failures(spec) -> list:
    p = A.build(spec)
    return A.check(p, A.run(p), A.reference(p))


def _report(spec, bad) -> str:
    return f"{spec}\n" + "\n".join(f"  {name}: error {err} > tolerance {tol}" for name, err, tol in bad)


@settings(max_examples=_ENV or EXAMPLES, deadline=None, derandomize=not _ENV, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=specs())
def test_every_path_matches_the_float64_reference(spec):
    bad = _failures(spec)
    assert not bad, _report(spec, bad)


# ====================================================================================== coverage of paths
def _limits(**changes) -> tuple:
    lim = {name: options[0] for name, options in A.LIMIT_OPTIONS.items()}
    lim.update(dict.fromkeys(A.AUTO_LIMITS, 0))
    lim.update(changes)
    return tuple(sorted(lim.items()))


def _spec(limits=None, **kw) -> A.Spec:
    base = dict(route="tiled", api="sdpa", kernels="numba", dtype="float32", lead=(2,), L=40, S=40, E=8, Ev=8)
    base.update(kw)
    return A.Spec(**base, limits=limits or _limits())


#: Problems each aimed at paths that need their own conditions (the drawn ones reach the rest).
EXPLICIT = [
    _spec(),                                                                   # the compiled loops, base 2
    _spec(amp=3.0, mask="causal"),                                             # …with lazy rescaling, causal
    _spec(limits=_limits(plain_loop=False)),                                   # base 2 in the Python loop
    _spec(limits=_limits(plain_loop=False), amp=3.0),                          # lazy, max pass by the kernels
    _spec(lead=(6,), kv_heads=2, mask="causal"),                               # grouped heads
    _spec(lead=(), L=3, S=64, threads=2, limits=_limits(block_k=8)),           # split-K
    _spec(api="flex", route="default", lead=(), L=3, S=64, threads=2, sinks=True, limits=_limits(block_k=8)),
    _spec(api="flex", L=64, S=64, mask_mod="sliding_window", mod_arg=9, block_size=8),              # tiles
    _spec(api="flex", L=64, S=64, mask_mod="sliding_window", mod_arg=9, block_size=8,                # bands
          limits=_limits(tile_loop=False)),
    _spec(api="flex", L=64, S=64, mask_mod="sliding_window", mod_arg=9, block_size=8, kernels="numpy"),
    _spec(api="flex", L=64, S=64, mask_mod="causal", block_size=16, score_mod="alibi", lead=(2,)),  # ALiBi fold
    _spec(api="flex", score_mod="softcap", cap=20.0, limits=_limits(plain_loop=False)),  # softcap's polynomial, fused
    _spec(api="flex", score_mod="softcap", cap=20.0, kernels="numpy"),         # …by NumPy's passes
    _spec(api="flex", score_mod="softcap", cap=1.0, sinks=True, limits=_limits(plain_loop=False)),   # tanh; sinks
    _spec(api="flex", score_mod="softcap", cap=20.0),                          # the compiled loop's mods
    _spec(api="engine", mask="causal", score_mod="alibi", L=64, S=64),
    _spec(api="engine", mask="causal", score_mod="alibi_softcap", cap=1.0, L=64, S=64, sinks=True),
    _spec(api="flex", score_mod="custom_grad", mask_mod="document", mod_arg=4, block_size=8, amp=3.0),
    _spec(api="flex", score_mod="custom_vjp", mask_mod="causal", block_size=8, kv_heads=1),    # the mod's vjp
    _spec(api="sdpa", mask="bool", dropout=0.25, weights=True),                # dropout
    _spec(api="sdpa", mask="float", weights=True, kernels="numpy", dtype="float64"),
    _spec(api="sdpa", mask="causal", kernels="numpy", dtype="float64", limits=_limits(diagonal_min=4)),
]


#: Problems aimed at paths that the families' problems (``matrix_families.every_family`` of the explicit ones)
#: need besides: lazy blocks under each mask mod (its argument 4 and 20); few heads' row shares.
FAMILY_EXPLICIT = [
    _spec(api="flex", amp=3.0, L=64, S=64, limits=_limits(plain_loop=False)),
    _spec(api="flex", amp=3.0, L=64, S=64, mod_arg=20, limits=_limits(plain_loop=False)),
    _spec(lead=(), L=130, S=64, threads=2, limits=_limits(block_q_plain=2048, block_q=256)),
]


def _big(**kw) -> A.Spec:
    """A problem at a size where the compiled loops run, on the engine's own limits (none moved)."""
    base = dict(route="tiled", api="flex", kernels="numba", dtype="float32", lead=(2,), L=640, S=640, E=16, Ev=16,
                threads=2, block_size=128, limits=())
    base.update(kw)
    return A.Spec(**base)


#: The compiled loops (``matrix_families.LARGE_PATHS``) with each family they take, at L ≥ 513 on the engine's own
#: limits — its 512-key blocks, 64-row bands, 32-cells and 16-row strips —, the block masks' boundaries inside
#: cells (off every multiple of 16), several documents to a cell, per batch, and many distinct tiles: where
#: the tile loop cuts its pieces, as it did wrongly for packed documents (commit 0b6fd78). Chosen, not drawn.
LARGE_PROBLEMS = [
    _big(api="sdpa"), _big(api="sdpa", mask="causal", L=600, S=600, threads=1),          # plain loops, fwd + bwd
    _big(api="sdpa", amp=3.0), _big(api="sdpa", mask="causal", amp=3.0, L=577, S=577),   # lazy
    _big(score_mod="softcap", cap=20.0), _big(api="engine", mask="causal", score_mod="alibi"),  # the mods' loop
    _big(mask_mod="causal", L=600, S=600),                                               # the tile loop
    _big(mask_mod="sliding_window", mod_arg=100, threads=1),
    _big(mask_mod="prefix_lm", mod_arg=200),
    _big(mask_mod="sinks", mod_arg=5, L=530, S=700),
    _big(mask_mod="streaming", mod_arg=70),
    _big(mask_mod="document", mod_arg=6, threads=1),                                     # six documents
    _big(mask_mod="document_lengths", mod_arg=40, block_size=32),                        # several a cell
    _big(mask_mod="document_batch", mod_arg=8, lead=(2, 2)),                             # per batch
    _big(mask_mod="and", mod_arg=6, seed=5),                                             # causal & documents
    _big(mask_mod="or", mod_arg=100),
    _big(mask_mod="custom_tiles", block_size=32),                                        # many distinct tiles
    _big(mask_mod="custom_head", lead=(3,), block_size=32, threads=1),
    _big(api="engine", mask="causal", mask_mod="document", mod_arg=6, seed=3),
]


def _seeded(n: int) -> list:
    return [A.draw_spec(A.numpy_chooser(np.random.default_rng(seed))) for seed in range(n)]


def test_the_matrix_walks_every_registered_path():
    """Every path the engine registers (``qkv.paths.registered()``) is taken by the matrix's problems — the
    generator over fixed seeds, the explicit ones above, those recast to every mask family and the large ones —
    so a new fast path cannot land unwalked; and every path with every mask family it takes
    (``matrix_families.SUPPORT``): the compiled loops' at L ≥ 513, their layout families with boundaries inside
    cells and many distinct tiles. Prints the path × family table it walked (``pytest -s`` or ``-rP``)."""
    pytest.importorskip("numba")                       # the compiled kernels' paths (the dev extras bring it)
    problems = _seeded(200) + EXPLICIT + MF.every_family(EXPLICIT + FAMILY_EXPLICIT) + LARGE_PROBLEMS
    pairs: Counter = Counter()
    seen: set = set()
    for spec in problems:                              # (one counting block a problem: they do not nest)
        p = A.build(spec)
        with paths.counting() as took:
            bad = A.check(p, A.run(p), A.reference(p))
        assert not bad, _report(spec, bad)
        seen.update(took)
        fam = MF.family(spec)
        tiles = MF.layout(p) if max(spec.L, spec.S) >= MF.LARGE and fam in MF.LAYOUT_FAMILIES else 0
        pairs.update((name, fam) for name in took if MF.credited(name, fam, spec, tiles))
    registered = sorted(paths.registered())
    print("\nthe matrix's paths × mask families (runs; compiled loops at L ≥ 513 only):\n"
          + MF.table(pairs, registered))
    missing = sorted(set(registered) - set(seen))
    assert not missing, "paths the matrix never took:\n" + "\n".join(
        f"  {name}: {paths.describe(name)}" for name in missing)
    undeclared = [name for name in registered if MF.supported(name) is None]
    assert not undeclared, "paths without their mask families in tests/matrix_families.py SUPPORT: " + ", ".join(
        undeclared)
    unwalked = [(name, fam) for name in registered for fam in MF.supported(name) if not pairs[(name, fam)]]
    assert not unwalked, "(path, mask family) pairs the path takes that the matrix never walked{}:\n{}".format(
        " (compiled loops: at L ≥ 513, layout families with boundaries inside cells)",
        "\n".join(f"  {name} × {fam}" for name, fam in unwalked))
