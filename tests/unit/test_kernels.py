"""The fused block kernels (qkv.kernels, compiled by numba from qkv.compute._jit): each kernel against float64 NumPy,
the engine with them against the reference and against the engine on NumPy's passes (every path that uses
them, counted, so a path that bypasses them fails), the choice, and that small work never imports numba."""
import os
import subprocess
import sys

import numpy as np
import pytest

import qkv
from qkv import kernels, mods
from qkv.backends import tiled

#: make check leaves this file out (10 s or more on 2 cores, or whole command-line runs); make test runs it.
pytestmark = pytest.mark.slow

jit = pytest.importorskip("qkv.compute._jit", reason="needs numba (the jit extra)")

NO_MASK = kernels.NO_MASK


def _rows(s, add=None, d=NO_MASK, rep=1, kind="exp", arg=None, base2=False):
    s = np.array(s, np.float32)
    add = np.zeros(s.shape[0], np.float32) if add is None else np.asarray(add, np.float32)
    sums = np.empty(s.shape[0], np.float32)
    kernels.run(jit, s, sums, (kind, arg, add, d, rep), base2=base2)
    return s, sums


# ---------------------------------------------------------------------------------------------- the kernels
def test_exp_rows_is_exp_to_float32_rounding(rng):
    x = np.clip(rng.standard_normal((300, 257)) * 20, -87, 88).astype(np.float32)   # odd width
    got, sums = _rows(x)
    want = np.exp(x.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=2.5e-7, atol=0)
    np.testing.assert_allclose(sums, want.sum(1), rtol=2e-6)


def test_exp_rows_is_exp_on_a_dense_grid_and_the_max_pass_too():
    # every float32 exponent the engine meets, 2·10⁶ points: the reduction's and the polynomial's error
    # together stay within 2.5e-7 relative (measured 2.09e-7; float32 np.exp's own is 1.2e-7)
    x = np.linspace(-87, 88, 2_000_001, dtype=np.float32)[None]
    want = np.exp(x.astype(np.float64))
    got, sums = _rows(x)
    np.testing.assert_allclose(got, want, rtol=2.5e-7, atol=0)
    x = x[:, :2_000_000]
    s, seen = x.reshape(1000, -1).copy(), np.zeros(1000, bool)
    sums, shift, hit = np.empty(1000, np.float32), np.empty(1000, np.float32), np.empty(1000, bool)
    kernels.run_max(jit, s, sums, ("exp", None, np.zeros(1000, np.float32), NO_MASK, 1), seen, shift, hit)
    np.testing.assert_array_equal(shift, x.reshape(1000, -1).max(1))        # the row max: exact
    assert hit.all()
    np.testing.assert_allclose(s, np.exp(x.reshape(1000, -1).astype(np.float64) - shift[:, None]), rtol=2.5e-7)


def test_the_bounded_exp_is_the_exp_on_its_range():
    # without the clamps, for arguments a caller knows are in [−87, 88] (a shift-free block's): the same error
    x = np.linspace(-87, 88, 2_000_001, dtype=np.float32)[None]
    s, sums = x.copy(), np.empty(1, np.float32)
    kernels.run(jit, s, sums, ("exp", None, np.zeros(1, np.float32), NO_MASK, 1), bounded=True)
    np.testing.assert_allclose(s, np.exp(x.astype(np.float64)), rtol=2.5e-7, atol=0)
    d = np.float32(0.25) * np.arange(-12, 12, dtype=np.float32).reshape(3, 8)          # the diagonal's limit too
    want, _ = _rows(d, d=0)                                                              # with the clamps
    s = d.copy()
    kernels.run(jit, s, np.empty(3, np.float32), ("exp", None, np.zeros(3, np.float32), 0, 1), bounded=True)
    np.testing.assert_array_equal(s, want)


def test_exp2_is_2_to_the_s_on_its_range_and_masks_the_diagonal(rng):
    # base 2 (the engine's plain blocks, log₂ e folded into the query rows): every float32 exponent 2^n stays
    # normal for, 2·10⁶ points, within 2e-7 relative (measured 1.66e-7: the polynomial's 9.1e-8 and rounding)
    x = np.linspace(-126, 127, 2_000_001, dtype=np.float32)[None]
    s, _ = _rows(x, base2=True)
    want = np.exp2(x.astype(np.float64))
    np.testing.assert_allclose(s, want, rtol=2e-7, atol=0)
    # e^score from the score times log₂ e (the float32 product the engine's matmul gives): the product's
    # rounding is the argument's, not the exponential's — against exp of the score itself, 30·2⁻²⁴·ln 2 more
    y = np.linspace(-30, 30, 600_001, dtype=np.float32)
    s, _ = _rows((y * np.float32(tiled.forward_pass._LOG2E))[None], base2=True)
    np.testing.assert_allclose(s[0], np.exp(y.astype(np.float64)), rtol=2e-7 + 30 * 2.0 ** -24)
    x = rng.uniform(-40, 40, (12, 9)).astype(np.float32)
    for d, rep in [(0, 1), (-2, 1), (3, 1), (0, 3), (-1, 2), (20, 1), (-20, 1)]:
        s, sums = _rows(x, d=d, rep=rep, base2=True)
        allowed = np.arange(9)[None, :] <= d + np.arange(12)[:, None] // rep
        want = np.where(allowed, np.exp2(x.astype(np.float64)), 0.0)
        np.testing.assert_allclose(s, want, rtol=2e-7, atol=0, err_msg=f"d={d} rep={rep}")
        np.testing.assert_allclose(sums, want.sum(1), rtol=2e-6, atol=1e-30)


def test_exp2_rounds_halfway_arguments_to_even_and_stays_exact_there():
    # n = roundeven(s) (one instruction): at s = k + ½ the reduction is r = ±½, the polynomial's ends, and
    # 2^n must be the n the rounding chose — halves, the floats either side of them, and of the integers
    h = np.arange(-125.5, 127.0, 1.0, dtype=np.float32)
    k = np.arange(-125.0, 127.0, 1.0, dtype=np.float32)
    x = np.concatenate([h, np.nextafter(h, np.float32(np.inf)), np.nextafter(h, np.float32(-np.inf)), k,
                        np.nextafter(k, np.float32(np.inf)), np.nextafter(k, np.float32(-np.inf))])
    x = np.resize(x, (x.size // 64 + 1) * 64).reshape(-1, 64)          # rows of 64: the vector loop runs
    s, _ = _rows(x, base2=True)
    np.testing.assert_allclose(s, np.exp2(x.astype(np.float64)), rtol=2e-7, atol=0)


def test_exp2_adds_the_row_term_on_rows_wide_enough_to_vectorize(rng):
    # 2^(s + add) with a row term, on rows of 512 (the vector loop runs): in the exponential's loop LLVM had
    # regrouped (s + a) + 1.5·2²³ and hoisted a + 1.5·2²³, rounding n from round(a) — 1.7e-4 off; rows of
    # 9, in the scalar tail, did not show it
    x = rng.uniform(-60, 40, (64, 512)).astype(np.float32)
    add = rng.uniform(-40, 20, 64).astype(np.float32)
    for d in (NO_MASK, 100):
        s, sums = _rows(x, add, d=d, base2=True)
        allowed = np.arange(512)[None, :] <= d + np.arange(64)[:, None]
        want = np.where(allowed, np.exp2((x + add[:, None]).astype(np.float64)), 0.0)
        np.testing.assert_allclose(s, want, rtol=2e-7, atol=0)
        np.testing.assert_allclose(sums, want.sum(1), rtol=2e-6)
    s, _ = _rows(x, add)                                                 # the natural exp, the same way
    np.testing.assert_allclose(s, np.exp((x + add[:, None]).astype(np.float64)), rtol=2.5e-7, atol=1.2e-38)


def test_base2_is_for_the_identity_only():
    s, sums = np.zeros((2, 4), np.float32), np.empty(2, np.float32)
    with pytest.raises(ValueError, match="base2 needs kind 'exp'"):
        kernels.run(jit, s, sums, ("tanh", np.float32(30), np.zeros(2, np.float32), NO_MASK, 1), base2=True)


def test_exp_rows_edges():
    x = np.array([[-np.inf, np.nan, 0.0, 1.0, -87.0, -88.0, -200.0, 88.0, 89.0, np.inf]], np.float32)
    got, _ = _rows(x)
    assert got[0, 0] == 0 and np.isnan(got[0, 1]) and got[0, 2] == 1
    np.testing.assert_allclose(got[0, 3], np.e, rtol=2e-7)
    np.testing.assert_allclose(got[0, 4], np.exp(-87.0), rtol=2.5e-7)   # still normal: exact
    assert got[0, 5] == 0 and got[0, 6] == 0                            # below 1.2e-38: 0
    np.testing.assert_allclose(got[0, 7], np.exp(88.0), rtol=2.5e-7)
    assert got[0, 8] == np.inf and got[0, 9] == np.inf                  # overflow: inf, as np.exp


def test_exp_rows_adds_the_row_term_and_masks_the_causal_diagonal(rng):
    x = rng.standard_normal((12, 9)).astype(np.float32)
    add = rng.standard_normal(12).astype(np.float32)
    for d, rep in [(0, 1), (-2, 1), (3, 1), (0, 3), (-1, 2), (20, 1), (-20, 1)]:
        got, sums = _rows(x, add, d, rep)
        rows = np.arange(12)[:, None] // rep
        allowed = np.arange(9)[None, :] <= d + rows
        # the argument is the float32 sum (as NumPy's s + add): its rounding is not the exponential's error
        want = np.where(allowed, np.exp((x + add[:, None]).astype(np.float64)), 0.0)
        np.testing.assert_allclose(got, want, rtol=2.5e-7, atol=0, err_msg=f"d={d} rep={rep}")
        np.testing.assert_allclose(sums, want.sum(1), rtol=2e-6, atol=1e-30)


def test_softcap_kernels_equal_cap_tanh_then_exp(rng):
    y = (rng.standard_normal((64, 300)) * 0.3).astype(np.float32)
    cap = 30.0
    want = np.exp(cap * np.tanh(y.astype(np.float64)) - 1.5)
    got, sums = _rows(y, np.full(64, -1.5), kind="tanh", arg=np.float32(cap))
    # cap·tanh to float32 rounding of a number up to cap (≈ cap·6e-8), then exp: 4e-6 relative at cap 30
    np.testing.assert_allclose(got, want, rtol=4e-6)
    wide = np.linspace(-12, 12, 4801, dtype=np.float32)[None]
    got, _ = _rows(wide, kind="tanh", arg=np.float32(1.0))
    np.testing.assert_allclose(np.log(got.astype(np.float64)), np.tanh(wide.astype(np.float64)), rtol=0, atol=5e-7)
    # the fitted polynomial (the engine's, for |y| ≤ bound), as seven coefficients
    a = tiled.scoring._tanh_poly(0.5)
    coef = np.zeros(7, np.float32)
    coef[:len(a)] = np.array(a) * cap
    y = rng.uniform(-0.5, 0.5, (64, 300)).astype(np.float32)
    got, _ = _rows(y, kind="poly", arg=coef)
    np.testing.assert_allclose(got, np.exp(cap * np.tanh(y.astype(np.float64))), rtol=4e-6)
    short = tiled.scoring._tanh_poly(0.25)                                       # four terms: the short loop
    assert len(short) <= 4
    coef = np.zeros(7, np.float32)
    coef[:len(short)] = np.array(short) * cap
    y = rng.uniform(-0.25, 0.25, (8, 100)).astype(np.float32)
    got, _ = _rows(y, kind="poly", arg=coef)
    np.testing.assert_allclose(got, np.exp(cap * np.tanh(y.astype(np.float64))), rtol=4e-6)


@pytest.mark.parametrize("kind", ["exp", "poly", "tanh"])
def test_max_pass_kernel_equals_the_numpy_max_pass(rng, kind):
    # the engine's max pass: v = f(s) + add (masked), m = row max, shift = max(m, 0) where the row had a max
    # already, else m (0 for a row with nothing allowed), p = exp(v − shift)
    rows, width = 10, 37
    y = (rng.standard_normal((rows, width)) * (0.3 if kind != "exp" else 5)).astype(np.float32)
    add = rng.standard_normal(rows).astype(np.float32)
    seen = np.array([True, False] * 5)
    d, rep = -4, 2                                                       # rows 0–7 see nothing at first
    if kind == "poly":
        a = tiled.scoring._tanh_poly(0.5)
        arg = np.zeros(7, np.float32)
        arg[:len(a)] = np.array(a) * 20
        f = 20 * np.tanh(y.astype(np.float64))
    elif kind == "tanh":
        arg, f = np.float32(20), 20 * np.tanh(y.astype(np.float64))
    else:
        arg, f = None, y.astype(np.float64)
    allowed = np.arange(width)[None, :] <= d + np.arange(rows)[:, None] // rep
    v = np.where(allowed, f + add[:, None], -np.inf)
    m = v.max(1)
    hit_want = np.isfinite(m)
    shift_want = np.where(seen, np.maximum(m, 0), np.where(hit_want, m, 0))
    p_want = np.exp(v - shift_want[:, None])
    s = y.copy()
    sums, shift, hit = np.empty(rows, np.float32), np.empty(rows, np.float32), np.empty(rows, bool)
    kernels.run_max(jit, s, sums, (kind, arg, add, d, rep), seen, shift, hit)
    np.testing.assert_array_equal(hit, hit_want)
    assert not hit[:2].any() and hit[-1]
    np.testing.assert_allclose(shift, shift_want, rtol=4e-6, atol=1e-6)
    np.testing.assert_allclose(s, p_want, rtol=5e-6, atol=1e-30)
    np.testing.assert_allclose(sums, p_want.sum(1), rtol=5e-6, atol=1e-30)


# ---------------------------------------------------------------------------------------------- the engine
@pytest.fixture
def counted(monkeypatch):
    """The engine's kernel calls counted (tiled.forward's plans and the bands' and backward's direct calls)."""
    calls = []
    real = kernels.run
    def krun(j, s, sums, plan, bounded=False, base2=False):
        calls.append(plan[0])
        calls.append("exp2" if base2 else "bounded" if bounded else "clamped")
        return real(j, s, sums, plan, bounded, base2)
    monkeypatch.setattr(kernels, "run", krun)
    real_rows = jit.exp_rows

    def rows(*a):
        calls.append("rows")
        return real_rows(*a)
    monkeypatch.setattr(jit, "exp_rows", rows)
    real_max = kernels.run_max
    monkeypatch.setattr(kernels, "run_max", lambda j, s, *a: (calls.append("max"), real_max(j, s, *a)))
    real_ds = jit.ds_rows
    monkeypatch.setattr(jit, "ds_rows", lambda *a: (calls.append("ds"), real_ds(*a)))
    real_bands = kernels.run_bands
    monkeypatch.setattr(kernels, "run_bands", lambda j, s, *a: (calls.append("bands"), real_bands(j, s, *a)))
    real_plain = kernels.run_plain                           # the compiled loop of plain blocks: base 2
    monkeypatch.setattr(kernels, "run_plain", lambda j, *a: (calls.extend(("plain", "exp2")), real_plain(j, *a)))
    real_tiles = kernels.run_tiles                           # …with a block mask's partial cells as tiles
    monkeypatch.setattr(kernels, "run_tiles", lambda j, *a: (calls.extend(("tiles", "exp2")), real_tiles(j, *a)))
    real_mods = kernels.run_mods                             # …with ALiBi, a softcap or both
    monkeypatch.setattr(kernels, "run_mods", lambda j, *a: (calls.extend(("mods", "exp2")), real_mods(j, *a)))
    real_lazy = kernels.run_plain_lazy                       # …its lazy rescaling (the max pass compiled in)
    monkeypatch.setattr(kernels, "run_plain_lazy", lambda j, *a: (calls.append("plain lazy"), real_lazy(j, *a)))
    real_plain_bw = kernels.run_plain_backward               # …and the backward's (exp_rows, ds_rows compiled in)
    monkeypatch.setattr(kernels, "run_plain_backward",
                        lambda j, *a: (calls.append("plain backward"), real_plain_bw(j, *a)))
    monkeypatch.setattr(kernels.KERNELS, "choice", "auto")
    return calls


def _inputs(rng, H=2, Hk=None, L=700, S=900, E=32, amp=1.0):
    Hk = Hk or H
    q = (rng.standard_normal((1, H, L, E)) * amp).astype(np.float32)
    k = (rng.standard_normal((1, Hk, S, E)) * amp).astype(np.float32)
    v = rng.standard_normal((1, Hk, S, 24)).astype(np.float32)
    return q, k, v


def _with_numpy(fn, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(kernels.KERNELS, "choice", "numpy")
        return fn()


CASES = {
    "full": dict(),
    "causal": dict(is_causal=True),
    "large scores (lazy)": dict(amp=4.0),
    "large scores, causal": dict(amp=4.0, is_causal=True),
    "gqa causal (grouped rows)": dict(H=6, Hk=2, is_causal=True, enable_gqa=True),
    "bool mask": dict(mask=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_forward_and_backward_with_kernels(rng, counted, monkeypatch, case):
    kw = dict(CASES[case])
    q, k, v = _inputs(rng, H=kw.pop("H", 2), Hk=kw.pop("Hk", None), amp=kw.pop("amp", 1.0))
    if kw.pop("mask", False):
        kw["attn_mask"] = rng.random((700, 900)) > 0.3
    kw["scale"] = 0.2
    out, _, lse = tiled.forward(q, k, v, return_lse=True, threads=2, **kw)
    assert counted, "the forward did not use the kernels"
    if "large" in case:       # lazy rescaling: the max pass and the lazy blocks (in the compiled loop, no mask)
        assert ("max" in counted and "exp" in counted) or "plain lazy" in counted, counted
        assert "plain lazy" in counted
    # shift-free blocks with nothing masked but the diagonal take base 2 (log₂ e in the query rows, no clamps);
    # lazy ones (scores minus a running max can be below −88) and masked ones (−inf) never do, and none here
    # takes the natural exp without clamps (shift-free blocks read again do: the test below)
    plain = case in ("full", "causal", "gqa causal (grouped rows)")
    assert ("exp2" in counted) == plain and "bounded" not in counted, counted
    ref = qkv.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                           backend="reference", **kw)
    # float32 scores up to ~80 carry ~1e-5 of rounding into exp: the float32 reference is off as much
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=5e-5 if "large" in case else 2e-6)
    base = _with_numpy(lambda: tiled.forward(q, k, v, return_lse=True, threads=2, **kw), monkeypatch)
    np.testing.assert_allclose(lse, base[2], rtol=1e-6, atol=1e-5)
    counted.clear()
    g = rng.standard_normal(out.shape).astype(np.float32)
    grads = tiled.backward(g, q, k, v, threads=2, **kw)
    assert ("ds" in counted and "rows" in counted) or "plain backward" in counted, "the backward used no kernel"
    assert ("plain backward" in counted) == (case != "bool mask"), counted   # no mod, no mask but causal
    want = _with_numpy(lambda: tiled.backward(g, q, k, v, threads=2, **kw), monkeypatch)
    for a, b in zip(grads, want):
        # large scores: each P = exp(S − lse) carries ~1e-5 of float32 rounding (as the forward's), and the
        # gradients' sums of them as much of their largest element (measured against float64 autograd: both
        # paths 5e-6–1e-5 of it, apart 3e-6); small ones stay at the elementwise bound
        atol = 2e-5 * max(1.0, float(np.abs(b).max())) if "large" in case else 2e-5
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)


FLEX = {
    "softcap, polynomial": dict(score_mod=mods.softcap(20.0)),
    "softcap, polynomial (the Python loop)": dict(score_mod=mods.softcap(20.0), limits=dict(plain_loop=False)),
    "softcap, tanh (large bound)": dict(score_mod=mods.softcap(20.0), amp=6.0),
    "softcap causal": dict(score_mod=mods.softcap(20.0), mask=mods.causal()),
    "alibi causal": dict(score_mod=mods.alibi(mods.alibi_slopes(2)), mask=mods.causal()),
    "sliding window (bands)": dict(mask=mods.sliding_window(128), limits=dict(tile_loop=False)),
    "sliding window (tiles)": dict(mask=mods.sliding_window(128)),
    "prefix LM (tiles)": dict(mask=mods.prefix_lm(150)),
    "window + softcap": dict(score_mod=mods.softcap(20.0), mask=mods.sliding_window(200)),
    "window + alibi": dict(score_mod=mods.alibi(mods.alibi_slopes(2)), mask=mods.sliding_window(128)),
    "documents + sinks": dict(mask=mods.document_from_lengths([300, 200, 200]), sinks=True),
}


@pytest.mark.parametrize("case", list(FLEX))
def test_flex_with_kernels_equals_reference_and_numpy(rng, counted, monkeypatch, case):
    kw = dict(FLEX[case])
    q, k, v = _inputs(rng, L=700, S=700, amp=kw.pop("amp", 1.0))
    mask = kw.pop("mask", None)
    if mask is not None:
        kw["block_mask"] = qkv.create_block_mask(mask, None, None, 700, 700)
    if kw.pop("sinks", False):
        kw["sink_logits"] = np.array([0.5, -1.0], np.float32)
    with tiled.limits(**kw.pop("limits", {})):
        got = qkv.flex_attention(q, k, v, **kw)
    assert counted, "flex attention did not use the kernels"
    if "(bands)" in case:
        assert "bands" in counted, "the window's bands did not use the kernel"
    if "(tiles)" in case or case == "documents + sinks":
        assert "tiles" in counted, "the block mask's cells did not take the compiled loop with tiles"
    ref = qkv.flex_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), backend="reference",
                             **{n: (x.astype(np.float64) if n == "sink_logits" else x) for n, x in kw.items()})
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=2e-5)
    base = _with_numpy(lambda: qkv.flex_attention(q, k, v, **kw), monkeypatch)
    np.testing.assert_allclose(got, base, rtol=1e-4, atol=2e-5)


def test_float64_stays_on_numpy(rng, counted):
    q, k, v = (x.astype(np.float64) for x in _inputs(rng))
    out = tiled.forward(q, k, v, scale=0.2, threads=1)[0]
    assert not counted
    ref = qkv.scaled_dot_product_attention(q, k, v, backend="reference", scale=0.2)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)


# ---------------------------------------------------------------------------------------------- the choice
def test_choice_and_errors(monkeypatch):
    monkeypatch.setattr(kernels.KERNELS, "choice", "auto")
    assert qkv.kernels.get_kernels() == "numba"
    kernels.set_kernels("numpy")
    assert kernels.get_kernels() == "numpy"
    assert kernels.KERNELS.describe() == "numpy"
    kernels.set_kernels("numba")
    assert kernels.KERNELS.describe().startswith("numba ")
    with pytest.raises(ValueError, match=r"name: expected one of \('auto', 'numpy', 'numba'\), got 'fast'"):
        kernels.set_kernels("fast")
    with pytest.raises(TypeError, match="name: expected a str"):
        kernels.set_kernels(1)
    # without numba: auto falls back to NumPy; asking for numba names the extra
    monkeypatch.setattr(kernels.KERNELS, "_jit", False)
    monkeypatch.setattr(kernels.KERNELS, "error", "ModuleNotFoundError: No module named 'numba'")
    with pytest.raises(ValueError, match=r"pip install 'qkv\[jit\]'"):
        kernels.set_kernels("numba")
    monkeypatch.setattr(kernels.KERNELS, "choice", "auto")
    assert kernels.get_kernels() == "numpy"
    assert kernels.KERNELS.for_call(np.dtype(np.float32), 1 << 20) is None


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_small_work_never_imports_numba_and_the_environment_chooses():
    code = ("import sys, numpy as np, qkv\n"
            "x = np.ones((1, 2, 16, 8), np.float32)\n"
            "qkv.scaled_dot_product_attention(x, x, x)\n"
            "print('numba' in sys.modules, qkv.kernels.get_kernels())\n")
    r = _python(code, QKV_KERNELS="")
    assert r.stdout.split() == ["False", "numba"], r.stderr
    r = _python(code.replace("(1, 2, 16, 8)", "(1, 2, 512, 64)"), QKV_KERNELS="")
    assert r.stdout.split() == ["True", "numba"], r.stderr
    r = _python(code.replace("(1, 2, 16, 8)", "(1, 2, 512, 64)"), QKV_KERNELS="numpy")
    assert r.stdout.split() == ["False", "numpy"], r.stderr
    r = _python(code, QKV_KERNELS="bogus")
    assert "QKV_KERNELS: expected one of ('auto', 'numpy', 'numba'), got 'bogus'; using 'auto'" in r.stderr


def _kernel_and_numpy(monkeypatch, kernel: str, fn, x):
    """``fn`` on a copy of ``x`` with the kernels (their ``kernel`` counted: it must run once) and with NumPy's
    passes (``set_kernels("numpy")``: it must not run) → (with kernels, NumPy's, the calls)."""
    calls = []
    real = getattr(jit, kernel)
    monkeypatch.setattr(jit, kernel, lambda *a: (calls.append(1), real(*a)))
    got = fn(x.copy())
    assert calls == [1], "the kernel was not used"
    with monkeypatch.context() as m:
        m.setattr(kernels.KERNELS, "choice", "numpy")
        base = fn(x.copy())
    assert calls == [1], "the kernel ran where NumPy's passes were chosen"
    return got, base, calls


def test_swiglu_kernel_equals_numpy(rng, monkeypatch):
    # the decoder's SwiGLU, g·u / (1 + e^(−g)), in one pass where the kernels are loaded and the block is large
    from qkv.models._rowwise import swiglu_
    kernels.KERNELS.for_call(np.dtype(np.float32), kernels.KERNEL_MIN)
    gu = (rng.standard_normal((64, 2 * 512)) * 4).astype(np.float32)
    gu[0, :4] = [-100.0, 100.0, 0.0, -np.inf]
    gu[0, 512:516] = [3.0, 2.0, 5.0, 1.0]
    with np.errstate(invalid="ignore"):
        got, base, calls = _kernel_and_numpy(monkeypatch, "swiglu_rows", swiglu_, gu)
    g, u = gu[:, :512].astype(np.float64), gu[:, 512:].astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        want = g * u / (1 + np.exp(-g))
    np.testing.assert_allclose(got[1:], want[1:], rtol=5e-7, atol=1e-30)
    np.testing.assert_allclose(got, base, rtol=5e-7, atol=1e-30)
    assert got[0, 0] == 0 and got[0, 1] == 200 and got[0, 2] == 0      # e^(100) = inf: ±0; e^(−100) = 0


def test_rms_norm_kernel_equals_numpy_and_float64(rng, monkeypatch):
    # the decoder's RMSNorm in one pass where the kernels are loaded and the rows are many: float64 Σ x²
    from qkv.models._rowwise import rms_norm
    kernels.KERNELS.for_call(np.dtype(np.float32), kernels.KERNEL_MIN)
    x = (rng.standard_normal((64, 576)) * 30).astype(np.float32)
    x[1] = 0.0                                                         # eps alone: zeros out
    x[2, 5] = 1e30                                                     # x² overflows float32, not float64
    w = rng.standard_normal(576).astype(np.float32)
    with np.errstate(over="ignore"):
        got, base, calls = _kernel_and_numpy(monkeypatch, "rms_norm_rows", lambda a: rms_norm(a, w, 1e-6), x)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(got[[0, *range(3, 64)]], base[[0, *range(3, 64)]], rtol=1e-6, atol=1e-30)
    assert np.all(got[1] == 0) and np.isfinite(got[2]).all() and got[2, 5] != 0   # NumPy's Σ x²: inf there
    out = np.empty_like(x)
    assert rms_norm(x, w, 1e-6, out=out) is out and len(calls) == 2
    nan = x.copy()
    nan[3, 7] = np.nan
    assert np.isnan(rms_norm(nan, w, 1e-6)[3]).all() and np.isfinite(rms_norm(nan, w, 1e-6)[4]).all()


def test_rope_kernel_is_bit_for_bit_numpys_rope(rng, monkeypatch):
    # RoPE on Q and K side by side in [Q | K | V] rows, one pass: each product rounded as NumPy's (no FMA)
    from qkv.models._rowwise import rope_rows_
    kernels.KERNELS.for_call(np.dtype(np.float32), kernels.KERNEL_MIN)
    rows = (rng.standard_normal((300, 15 * 64)) * 3).astype(np.float32)   # 9 Q + 3 K heads rotated, 3 V not
    cos, sin = qkv.positions.cos_sin(np.arange(7, 307), 64, theta=100000.0, dtype=np.float32)   # (300, 32)
    got, base, _ = _kernel_and_numpy(monkeypatch, "rope_rows", lambda a: rope_rows_(a, 12, cos, sin, 64), rows)
    heads = rows[:, :12 * 64].reshape(300, 12, 64)
    want = qkv.stages.rope(heads, cos[:, None], sin[:, None], style="neox")
    np.testing.assert_array_equal(got[:, :12 * 64].reshape(300, 12, 64), want)
    np.testing.assert_array_equal(got, base)
    np.testing.assert_array_equal(got[:, 12 * 64:], rows[:, 12 * 64:])  # V untouched


def test_col_extents_kernel_equals_the_checks_extents(rng, monkeypatch):
    # max |x| of Q's, K's and V's columns in one pass; None where a range holds NaN or ±inf, as the checks'
    from qkv.models._rowwise import col_extents
    kernels.KERNELS.for_call(np.dtype(np.float32), kernels.KERNEL_MIN)
    x = (rng.standard_normal((200, 960)) * 5).astype(np.float32)
    x[17, 3] = -40.0                                                   # the extent from a negative value
    edges = (0, 576, 768, 960)
    for bad in (None, np.inf, -np.inf, np.nan):
        y = x.copy()
        if bad is not None:
            y[150, 700] = bad                                          # in K's columns only
        got, base, _ = _kernel_and_numpy(monkeypatch, "col_extents", lambda a: col_extents(a, edges), y)
        want = [float(np.abs(y[:, a:b]).max()) for a, b in zip(edges[:-1], edges[1:])]
        assert got == base
        assert got[0] == 40.0 and got[2] == want[2]
        assert got[1] == (want[1] if bad is None else None)
        monkeypatch.undo()


def test_gelu_kernel_equals_numpy_and_erf(rng, monkeypatch):
    # MiniLM's exact GELU, h·½(1 + erf(h/√2)), in one pass where the kernels are loaded and the block is large
    import math
    from qkv.models.bert import gelu_
    kernels.KERNELS.for_call(np.dtype(np.float32), kernels.KERNEL_MIN)
    h = (rng.standard_normal((64, 1536)) * 3).astype(np.float32)
    h[0, :6] = [0.0, -6.0, 6.0, 40.0, -40.0, 1e-30]                    # beyond the clip at |h/√2| = 4 too
    got, base, calls = _kernel_and_numpy(monkeypatch, "gelu_rows", gelu_, h)
    x = h.astype(np.float64)
    want = x * 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    # float32's 1 + erf(z) cancels for negative h (erf → −1): an error of about |h|·1e-7 either way, so the
    # kernel is held to the float64 value by that bound and to NumPy's own error (as FlashAttention's tests)
    err, err_numpy = np.abs(got - want), np.abs(base - want)
    assert np.all(err <= 2e-6 * np.abs(want) + 2e-7 * np.abs(x) + 1e-30), float((err / (np.abs(x) + 1e-30)).max())
    assert err.max() <= 2 * err_numpy.max()
    assert got[0, 0] == 0 and got[0, 2] == 6 and got[0, 3] == 40 and got[0, 4] == 0
    small = h[:2, :100].copy()                                           # under KERNEL_MIN: NumPy's passes
    gelu_(small)
    assert len(calls) == 1


def test_inputs_without_lead_dimensions(rng, counted):
    # (L, E) arrays, no batch or head axis: the task's query rows come from the array itself
    q, k, v = (x[0, 0] for x in _inputs(rng))
    for causal in (False, True):
        out = tiled.forward(q, k, v, scale=0.2, is_causal=causal, threads=1)[0]
        ref = qkv.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                               scale=0.2, is_causal=causal, backend="reference")
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
    assert counted


@pytest.mark.parametrize("case", ["weights", "dropout", "block mask"])
def test_plain_blocks_whose_scores_are_read_again_stay_in_base_e(rng, counted, case):
    # base 2 changes the scores the blocks hold (times log₂ e): where anything else reads them — the weights'
    # second pass, dropout's kept probabilities, a block mask's cells in the Python loop (tile_loop off; in the
    # compiled loop its tiles multiply 2^s) — the blocks take e^s (without clamps where nothing is masked but
    # the diagonal)
    q, k, v = _inputs(rng)
    kw = dict(scale=0.2)
    if case == "weights":
        kw["return_weights"] = True
    elif case == "dropout":
        kw.update(dropout_p=0.25, rng=np.random.default_rng(3))
    else:
        kw["block_mask"] = qkv.create_block_mask(mods.causal(), None, None, 700, 900)
    with tiled.limits(tile_loop=False):
        out, w, _ = tiled.forward(q, k, v, threads=2, **kw)
    assert "exp2" not in counted and ("bounded" in counted) == (case != "block mask"), counted
    if case == "dropout":
        return
    ref = qkv.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                           backend="reference", scale=0.2,
                                           is_causal=case == "block mask")
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
    if case == "weights":
        s = np.einsum("bhle,bhse->bhls", q.astype(np.float64), k.astype(np.float64)) * 0.2
        want = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(w, want / want.sum(-1, keepdims=True), rtol=2e-5, atol=1e-7)


def test_base2_scale_is_rounded_once_and_the_bound_reads_the_input_rows(rng):
    # log₂ e goes into the scale (one rounding of each query value, as without base 2), and the shift-free
    # bound comes from the input rows' norms before they are scaled; grouped rows interleaved (r·g + h)
    q, k, v = _inputs(rng, H=6, Hk=2)
    P = tiled.plan._Problem(q, k, v, None, True, 0.2, True)
    P = P.with_cut(tiled.plan.Cut(group=3))
    got = np.empty((90, 32), np.float32)
    P.q_rows_group((0, 0), 10, 40, got, tiled.forward_pass._LOG2E)
    rows = q[0, :3, 10:40].transpose(1, 0, 2).reshape(90, 32)
    np.testing.assert_array_equal(got, rows * np.float32(0.2 * tiled.forward_pass._LOG2E))
    P.q_rows_group((0, 0), 10, 40, got)
    np.testing.assert_array_equal(got, rows * np.float32(0.2))
    want = np.linalg.norm(rows.astype(np.float64) * 0.2, axis=1).max()
    np.testing.assert_allclose(P.q_norm_group((0, 0), 10, 40), want, rtol=1e-6)
    assert P.q_norm_group((0, 0), 10, 10) == 0.0                       # no rows


def test_q_prep_reads_a_models_strided_query_rows_exactly():
    """A model's Q is a strided view (heads side by side in each row of the projection's output): the compiled
    pass reads it through a 1-D view of its memory, and writes NumPy's products (one rounding), rows
    interleaved by head; the largest squared norm in float64; NaN kept; a reversed axis left to NumPy."""
    L, H, E = 96, 6, 16
    rng = np.random.default_rng(3)
    proj = rng.standard_normal((L, 3 * H * E), dtype=np.float32)
    q = proj[:, :H * E].reshape(L, H, E).transpose(1, 0, 2)[2:5, 10:70]        # (g, n, E), not contiguous
    out = np.full((3 * 60, E + 1), 7.0, np.float32)
    m = kernels.q_prep(jit, q, out, 0.3)
    want = (q * np.float32(0.3)).transpose(1, 0, 2).reshape(-1, E)
    np.testing.assert_array_equal(out[:, :E], want)
    assert (out[:, E] == 0).all()
    assert m == pytest.approx((q.astype(np.float64) ** 2).sum(-1).max(), rel=1e-12)
    bad = q.copy()
    bad[1, 7, 3] = np.nan
    assert np.isnan(kernels.q_prep(jit, bad, out, 0.3))
    assert kernels.q_prep(jit, q[:, ::-1], out, 0.3) is None


def test_the_rope_stage_takes_the_kernel_bit_for_bit_where_it_can(rng, monkeypatch):
    # qkv.stages.rope ("neox", float32, C-contiguous, one angle row per position): a copy rotated by the
    # compiled pass, one (T, E) matrix at a time — NumPy's passes' numbers exactly; elsewhere NumPy's passes
    kernels.KERNELS.for_call(np.dtype(np.float32), kernels.KERNEL_MIN)
    x = (rng.standard_normal((2, 3, 300, 64)) * 3).astype(np.float32)
    calls = []
    real = jit.rope_rows
    monkeypatch.setattr(jit, "rope_rows", lambda *a: (calls.append(1), real(*a)))
    got = qkv.positions.rope(x, np.arange(7, 307), theta=100000.0)
    assert len(calls) == 6 and got.dtype == np.float32
    with monkeypatch.context() as m:
        m.setattr(kernels.KERNELS, "choice", "numpy")
        want = qkv.positions.rope(x, np.arange(7, 307), theta=100000.0)
    np.testing.assert_array_equal(got, want)
    assert not np.shares_memory(got, x)
    for other in (dict(style="interleaved"), dict(positions=np.tile(np.arange(300), (2, 1)))):
        qkv.positions.rope(x, **other)                                  # per-batch angles, interleaved pairs
    qkv.positions.rope(x.astype(np.float64))
    qkv.positions.rope(x[:, :, ::2])                                    # not contiguous
    assert len(calls) == 6
