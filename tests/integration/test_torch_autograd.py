"""qkv.torch against torch: the forward and every gradient against dense float64 torch autograd (scores → mod →
mask → softmax with the sink column → · V; torch's flex_attention has no backward on CPU), the forward against
torch's eager flex_attention and SDPA, gradcheck, dtypes, refusals, and a training loop that learns.

Mods are written with torch operations, as for torch's flex_attention; a score mod captures learnable tensors
(a per-head relative-position bias table, a scalar temperature) whose gradients must arrive.
"""
import os
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest

import qkv
from qkv import mods

torch = pytest.importorskip("torch")
import qkv.torch as qt  # noqa: E402
from qkv.integrations import _torch_mods  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask as t_block_mask  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention as t_flex  # noqa: E402

pytestmark = pytest.mark.torch
F64, F32 = torch.float64, torch.float32


def _rand(*shape, dtype=F64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype).requires_grad_()


def _window(w):
    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < w)
    return window


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _dense(q, k, v, score_mod=None, mask_mod=None, sinks=None, scale=None, gqa=False):
    """The attention in plain torch ops (autograd through it): output and lse, a dead row 0 / −inf."""
    if gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    B, H, L, S = q.shape[0], q.shape[1], q.shape[-2], k.shape[-2]
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    i, j = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
    if score_mod is not None:
        s = score_mod(s, b, h, i, j)
    if mask_mod is not None:
        s = s.masked_fill(~torch.broadcast_to(mask_mod(b, h, i, j), s.shape), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, H, 1, 1).expand(B, H, L, 1)], dim=-1)
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    out = (e / torch.where(total == 0, torch.ones_like(total), total))[..., :S] @ v
    return out, (m + torch.log(total)).squeeze(-1)


def _grads(out, inputs, seed=9):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(out.dtype)
    return torch.autograd.grad(out, inputs, g, allow_unused=True)


def _close(got, want, tol, what=""):
    got, want = got.detach().double(), want.detach().double()
    err = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


# ====================================================================================== flex, float64
B, H, L, E = 2, 4, 150, 16


def _learnable():
    """A per-head relative-position bias table and a scalar temperature, both learnable, captured by a mod."""
    bias = _rand(H, 2 * L, seed=5, scale=0.5)
    temp = torch.tensor(0.8, dtype=F64, requires_grad=True)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score * temp + bias[h, q_idx - kv_idx + L]
    return rel_bias, [bias, temp]


def _doc_mask():
    ids = torch.tensor([0] * 40 + [1] * 70 + [2] * 40)

    def document(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
    return document


CASES = {
    "sliding window, learnable bias, sinks": dict(mask=_window(40), learn=True, sinks=True),
    "causal, GQA": dict(mask=_causal, gqa=True),
    "GQA, learnable bias, sinks": dict(mask=_window(70), gqa=True, learn=True, sinks=True),
    "document": dict(mask=_doc_mask(), learn=True),
    "non-square torch blocks": dict(mask=_window(40), block=(64, 128)),
    "qkv BlockMask": dict(mask="qkv", learn=True),
    "per batch row and head": dict(mask="per_bh", learn=True),
    "no mask, no mod": dict(),
}


def _case(name, dtype=F64):
    c = CASES[name]
    hk = 2 if c.get("gqa") else H
    q, k, v = _rand(B, H, L, E, dtype=dtype, seed=1), _rand(B, hk, L, E, dtype=dtype, seed=2), \
        _rand(B, hk, L, E, dtype=dtype, seed=3)
    mod, captured = _learnable() if c.get("learn") else (None, [])
    sinks = _rand(H, seed=4) if c.get("sinks") else None
    mask_fn, bm = c.get("mask"), None
    if mask_fn == "per_bh":                               # built for B, H: each (b, h) its own window
        limits = torch.tensor([[20, 60, 150, 1], [7, 33, 90, 130]])

        def mask_fn(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < limits[b, h])
        bm = t_block_mask(mask_fn, B, H, L, L, device="cpu", BLOCK_SIZE=32)
    elif mask_fn == "qkv":
        mask_fn, bm = _window(33), qkv.create_block_mask(mods.sliding_window(33), None, None, L, L, BLOCK_SIZE=32)
    elif mask_fn is not None:
        bm = t_block_mask(mask_fn, None, None, L, L, device="cpu", BLOCK_SIZE=c.get("block", 128))
    return dict(q=q, k=k, v=v, mod=mod, captured=captured, sinks=sinks, mask_fn=mask_fn, bm=bm, gqa=bool(c.get("gqa")))


@pytest.mark.parametrize("name", list(CASES))
def test_flex_forward_and_every_gradient_match_dense_autograd_in_float64(name):
    c = _case(name)
    inputs = [c["q"], c["k"], c["v"]] + ([c["sinks"]] if c["sinks"] is not None else []) + c["captured"]
    out, lse = qt.flex_attention(c["q"], c["k"], c["v"], c["mod"], c["bm"], enable_gqa=c["gqa"], return_lse=True,
                                 sink_logits=c["sinks"])
    want, want_lse = _dense(c["q"], c["k"], c["v"], c["mod"], c["mask_fn"], c["sinks"], gqa=c["gqa"])
    _close(out, want, 1e-10, "out")
    _close(lse, want_lse, 1e-10, "lse")
    assert out.dtype == F64 and lse.dtype == F64
    for g, w, x in zip(_grads(out, inputs), _grads(want, inputs), inputs):
        _close(g, w, 1e-10, f"grad of {tuple(x.shape)}")


@pytest.mark.parametrize("L, S", [(100, 130), (130, 100), (1, 1), (1, 77), (77, 1), (129, 129)])
def test_awkward_sizes_and_three_dimensional_inputs(L, S):
    """(H, L, E) inputs, L ≠ S, single rows and keys, block boundaries ±1, a head-dependent mod and a mask that
    is not a function of i − j (the first three keys always visible)."""
    q, k, v = _rand(3, L, 8, seed=1), _rand(3, S, 8, seed=2), _rand(3, S, 5, seed=3)

    def mod(score, b, h, q_idx, kv_idx):
        return score - 0.1 * (q_idx - kv_idx).abs() + h

    def sinks_and_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | (kv_idx < 3)
    bm = t_block_mask(sinks_and_causal, None, None, L, S, device="cpu", BLOCK_SIZE=32)
    out = qt.flex_attention(q, k, v, mod, bm)
    want = _dense(q[None], k[None], v[None], mod, sinks_and_causal)[0][0]
    assert out.shape == (3, L, 5)
    _close(out, want, 1e-10, "out")
    for g, w in zip(_grads(out, [q, k, v]), _grads(want, [q, k, v])):
        _close(g, w, 1e-10, "grad")


def test_the_lse_is_differentiable_with_sinks_and_a_learnable_bias():
    c = _case("sliding window, learnable bias, sinks")
    inputs = [c["q"], c["k"], c["v"], c["sinks"]] + c["captured"]
    out, lse = qt.flex_attention(c["q"], c["k"], c["v"], c["mod"], c["bm"], return_lse=True, sink_logits=c["sinks"])
    want, want_lse = _dense(c["q"], c["k"], c["v"], c["mod"], c["mask_fn"], c["sinks"])
    w = torch.linspace(-1, 1, L, dtype=F64)
    for g, r in zip(torch.autograd.grad((out.sum(-1) + lse * w).sum(), inputs, retain_graph=True),
                    torch.autograd.grad((want.sum(-1) + want_lse * w).sum(), inputs, retain_graph=True)):
        _close(g, r, 1e-10, "grad through out and lse")
    lse_inputs = [c["q"], c["k"], c["sinks"]] + c["captured"]                   # the lse does not read v
    for g, r in zip(torch.autograd.grad(lse.sum(), lse_inputs), torch.autograd.grad(want_lse.sum(), lse_inputs)):
        _close(g, r, 1e-10, "grad through lse alone")


def test_float32_is_within_1e_5_of_float64():
    c = _case("sliding window, learnable bias, sinks")
    bias32 = c["captured"][0].detach().float().requires_grad_()
    temp32 = c["captured"][1].detach().float().requires_grad_()

    def mod32(score, b, h, q_idx, kv_idx):
        return score * temp32 + bias32[h, q_idx - kv_idx + L]
    q, k, v, sinks = (x.detach().float().requires_grad_() for x in (c["q"], c["k"], c["v"], c["sinks"]))
    out = qt.flex_attention(q, k, v, mod32, c["bm"], sink_logits=sinks)
    want = _dense(c["q"], c["k"], c["v"], c["mod"], c["mask_fn"], c["sinks"])[0]
    assert out.dtype == F32
    _close(out, want, 1e-5, "out")
    for g, w in zip(_grads(out, [q, k, v, sinks, bias32, temp32]),
                    _grads(want, [c["q"], c["k"], c["v"], c["sinks"]] + c["captured"])):
        assert g.dtype == F32
        _close(g, w, 2e-5, "grad")


@pytest.mark.parametrize("dtype", [F32, F64])
def test_flex_forward_equals_torchs_eager_flex_attention(dtype):
    c = _case("sliding window, learnable bias, sinks", dtype)
    bias, temp = (t.detach() for t in c["captured"])                   # torch's flex: no backward on CPU

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score * temp + bias[h, q_idx - kv_idx + L]
    c["mod"] = rel_bias
    c["q"], c["k"], c["v"] = (c[n].detach() for n in "qkv")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                          # torch: "called without torch.compile()"
        with torch.no_grad():
            want, want_lse = t_flex(c["q"], c["k"], c["v"], c["mod"], c["bm"], return_lse=True)
    out, lse = qt.flex_attention(c["q"], c["k"], c["v"], c["mod"], c["bm"], return_lse=True)
    tol = 1e-10 if dtype == F64 else 1e-5
    _close(out, want, tol, "out")
    _close(lse, want_lse, tol, "lse")


def test_a_query_that_may_attend_to_nothing_gives_zero_and_lse_minus_inf_as_torchs_flex():
    q, k, v = (_rand(1, 2, 64, 8, seed=s) for s in (1, 2, 3))

    def dead_rows(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx % 5 != 3)
    bm = t_block_mask(dead_rows, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        want, want_lse = t_flex(q.detach(), k.detach(), v.detach(), block_mask=bm, return_lse=True)
    out, lse = qt.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)) and (out[:, :, 3::5] == 0).all()
    _close(out, want, 1e-10, "out")
    dq = _grads(out, [q])[0]
    assert (dq[:, :, 3::5] == 0).all()


def test_gradcheck_through_a_captured_bias_and_sinks():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 4, generator=g, dtype=F64, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 18, generator=g, dtype=F64, requires_grad=True)
    sinks = torch.randn(2, generator=g, dtype=F64, requires_grad=True)
    bm = t_block_mask(_window(5), None, None, 9, 9, device="cpu")

    def f(q, k, v, bias, sinks):
        def mod(score, b, h, q_idx, kv_idx):
            return torch.tanh(score) * 2 + bias[h, q_idx - kv_idx + 9]
        out, lse = qt.flex_attention(q, k, v, mod, bm, return_lse=True, sink_logits=sinks)
        return out, lse
    assert torch.autograd.gradcheck(f, (q, k, v, bias, sinks), eps=1e-6, atol=1e-8)


def test_a_mod_that_works_in_place_is_differentiated_like_its_out_of_place_twin():
    q, k, v = (_rand(1, 2, 40, 8, seed=s) for s in (1, 2, 3))
    bm = t_block_mask(_causal, None, None, 40, 40, device="cpu")
    out = qt.flex_attention(q, k, v, lambda s, b, h, i, j: s.mul_(0.5).add_(h), bm)
    want = _dense(q, k, v, lambda s, b, h, i, j: s * 0.5 + h, _causal)[0]
    _close(out, want, 1e-10, "out")
    for g, w in zip(_grads(out, [q, k, v]), _grads(want, [q, k, v])):
        _close(g, w, 1e-10, "grad")


def test_a_qkv_score_mod_runs_as_it_is():
    q, k, v = (_rand(1, 4, 40, 8, seed=s) for s in (1, 2, 3))
    slopes = mods.alibi_slopes(4)
    out = qt.flex_attention(q, k, v, mods.alibi(slopes))
    want = _dense(q, k, v, lambda s, b, h, i, j: s + torch.from_numpy(slopes)[h] * (j - i))[0]
    _close(out, want, 1e-10, "out")
    for g, w in zip(_grads(out, [q, k, v]), _grads(want, [q, k, v])):
        _close(g, w, 1e-10, "grad")


def test_the_tiled_forward_and_backward_take_a_torch_mod_on_worker_threads():
    """Large enough for the tiled engine (2 threads): the captured bias's gradient summed over blocks."""
    q, k, v = (_rand(1, 2, 640, 16, seed=s) for s in (1, 2, 3))
    bias = _rand(2, 1280, seed=4, scale=0.3)
    threads = set()

    def mod(score, b, h, q_idx, kv_idx):
        if torch.is_grad_enabled():                                   # the backward's vjp
            threads.add(threading.get_ident())
        return score + bias[h, q_idx - kv_idx + 640]
    bm = t_block_mask(_window(200), None, None, 640, 640, device="cpu")
    with qkv.paths.counting() as seen:
        out = qt.flex_attention(q, k, v, mod, bm)
        got = _grads(out, [q, k, v, bias])
    assert seen["score.generic"] > 0 and seen["backward.mod_vjp"] > 0
    if len(os.sched_getaffinity(0)) >= 2 and qkv.get_num_threads() >= 2:
        assert len(threads) >= 2                                      # the bias's gradient summed across workers
    want = _dense(q, k, v, mod, _window(200))[0]
    _close(out, want, 1e-10, "out")
    for g, w in zip(got, _grads(want, [q, k, v, bias])):
        _close(g, w, 1e-10, "grad")


# ====================================================================================== torch's masks
def _converted(mask_fn, N=300, bs=32):
    return _torch_mods.block_mask_from_torch(t_block_mask(mask_fn, None, None, N, N, device="cpu", BLOCK_SIZE=bs),
                                             N, N)


def test_a_torch_mask_of_i_minus_j_is_proven_so_and_runs_on_cached_patterns():
    assert _converted(_window(40)).mask_mod.traits == mods.MaskTraits(invariant=True, diagonal=True, causal=True)
    both_ways = _converted(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < 40)
    assert both_ways.mask_mod.traits == mods.MaskTraits(invariant=True, diagonal=True, causal=False)
    q, k, v = (_rand(1, 2, 600, 16, seed=s) for s in (1, 2, 3))
    with qkv.paths.counting() as seen:
        out = qt.flex_attention(q, k, v, block_mask=t_block_mask(_window(100), None, None, 600, 600, device="cpu",
                                                                  BLOCK_SIZE=64))
        got = _grads(out, [q, k, v])
    assert seen["mask.pattern"] > 0 and seen["mask.mask_mod"] == 0
    want = _dense(q, k, v, None, _window(100))[0]
    _close(out, want, 1e-10, "out")
    for g, w in zip(got, _grads(want, [q, k, v])):
        _close(g, w, 1e-10, "grad")


def test_torchs_causal_block_mask_alone_runs_as_is_causal():
    """Proven i ≥ j on its grid, with no score mod and no sinks: SDPA's is_causal (the plain causal loops, no
    block mask), output, lse and their gradients as the dense formula's."""
    q, k, v = (_rand(1, 2, 600, 16, seed=s) for s in (1, 2, 3))
    bm = t_block_mask(_causal, None, None, 600, 600, device="cpu")
    with qkv.paths.counting() as seen:
        out, lse = qt.flex_attention(q, k, v, block_mask=bm, return_lse=True)
        got = torch.autograd.grad((out.sum(-1) + lse).sum(), [q, k, v])
    assert not {"mask.pattern", "mask.mask_mod"} & set(seen)
    want, want_lse = _dense(q, k, v, None, _causal)
    _close(out, want, 1e-10, "out")
    _close(lse, want_lse, 1e-10, "lse")
    for g, w in zip(got, torch.autograd.grad((want.sum(-1) + want_lse).sum(), [q, k, v])):
        _close(g, w, 1e-10, "grad")
    assert _torch_mods.is_causal(_converted(_causal)) and not _torch_mods.is_causal(_converted(_window(40)))


def test_a_mask_that_depends_on_more_than_i_minus_j_keeps_calling_the_mod():
    """Documents, and a mask whose partial blocks look like a function of i − j but whose full and empty blocks
    contradict it (block row 1 hides keys 0 … 127, block row 2 sees them): no traits, exact results."""
    def holed(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ~((q_idx >= 128) & (q_idx < 256) & (kv_idx < 128))
    assert _converted(holed, 384, 128).mask_mod.traits is None
    assert _converted(_doc_mask(), 150).mask_mod.traits is None
    q, k, v = (_rand(1, 2, 384, 16, seed=s) for s in (1, 2, 3))
    with qkv.paths.counting() as seen:
        out = qt.flex_attention(q, k, v, block_mask=t_block_mask(holed, None, None, 384, 384, device="cpu"))
    assert seen["mask.pattern"] == 0
    _close(out, _dense(q, k, v, None, holed)[0], 1e-10, "out")


# ============================================================================================ captures
class _Bias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(4, 8))
        self.frozen = torch.zeros(3)

    def mod(self, score, b, h, q_idx, kv_idx):
        return score + self.table[h, 0]


_GLOBAL_SCALE = torch.ones((), requires_grad=True)


def _global_mod(score, b, h, q_idx, kv_idx):
    return score * _GLOBAL_SCALE


def test_captured_tensors_are_found_as_torch_lifts_them():
    m = _Bias()
    assert [t is m.table for t in _torch_mods.captured_tensors(m.mod)] == [True]        # a module's method
    assert [t is _GLOBAL_SCALE for t in _torch_mods.captured_tensors(_global_mod)] == [True]
    w = torch.ones(2, requires_grad=True)
    plain = torch.ones(2)                                                             # no grad: not an input
    assert _torch_mods.captured_tensors(lambda s, b, h, i, j: s * w[0] + plain[0]) == [w]
    import functools
    assert _torch_mods.captured_tensors(functools.partial(lambda s, b, h, i, j, t: s * t, t=w)) == [w]


def test_a_module_parameter_gets_its_gradient():
    m = _Bias()
    q, k, v = (_rand(1, 4, 20, 8, seed=s) for s in (1, 2, 3))
    out = qt.flex_attention(q.float(), k.float(), v.float(), m.mod)
    out.sum().backward()
    assert m.table.grad is not None and m.table.grad[:, 1:].abs().max() == 0
    assert m.table.grad[:, 0].abs().max() < 1e-4          # softmax rows sum to 1: a per-row shift has no effect


# ================================================================================================ SDPA
@pytest.mark.parametrize("kind", ["none", "bool", "float", "causal", "gqa"])
def test_sdpa_matches_torchs_sdpa_forward_and_autograd(kind):
    q = _rand(2, 4, 33, 16, seed=1)
    hk = 2 if kind == "gqa" else 4
    k, v = _rand(2, hk, 47, 16, seed=2), _rand(2, hk, 47, 8, seed=3)
    g = torch.Generator().manual_seed(7)
    mask = {"bool": torch.rand(33, 47, generator=g) > 0.3,
            "float": torch.randn(2, 1, 33, 47, generator=g, dtype=F64)}.get(kind)
    kw = dict(attn_mask=mask, is_causal=kind == "causal", enable_gqa=kind == "gqa", scale=0.3)
    out = qt.scaled_dot_product_attention(q, k, v, **kw)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
    _close(out, want, 1e-10, "out")
    for a, b in zip(_grads(out, [q, k, v]), _grads(want, [q, k, v])):
        _close(a, b, 1e-10, "grad")


@pytest.mark.parametrize("shape", [(33, 47), (2, 1, 33, 47)])
def test_a_learnable_float_mask_gets_its_gradient(shape):
    """A float attn_mask that requires a gradient (a learned bias) gets torch's; GQA, a mask broadcast over heads
    or over batch and heads."""
    q, k, v = _rand(2, 4, 33, 16, seed=1), _rand(2, 2, 47, 16, seed=2), _rand(2, 2, 47, 8, seed=3)
    bias = _rand(*shape, seed=4)
    out = qt.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    _close(out, want, 1e-10, "out")
    for a, b in zip(_grads(out, [q, k, v, bias]), _grads(want, [q, k, v, bias])):
        assert a.shape == b.shape
        _close(a, b, 1e-10, "grad")


def test_sdpa_large_enough_for_the_tiled_backward():
    q, k, v = (_rand(1, 2, 600, 16, seed=s, dtype=F32) for s in (1, 2, 3))
    out = qt.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    _close(out, want, 1e-5, "out")
    for a, b in zip(_grads(out, [q, k, v]), _grads(want, [q, k, v])):
        _close(a, b, 2e-5, "grad")


def test_sdpa_dropout_is_reproducible_and_its_gradient_is_exact():
    q, k, v = (_rand(1, 2, 12, 4, seed=s) for s in (1, 2, 3))

    def f(q, k, v):
        torch.manual_seed(5)                                    # the mask: NumPy's, seeded from torch's
        return qt.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    a, b = f(q, k, v), f(q, k, v)
    assert torch.equal(a, b)
    plain = qt.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(a, plain)                          # something was dropped
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8)
    bias = _rand(12, 12, seed=4)

    def g(q, k, v, bias):                                        # dropout and a learnable float mask
        torch.manual_seed(6)
        return qt.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.3)
    assert torch.autograd.gradcheck(g, (q, k, v, bias), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32_and_returned_in_its_dtype(dtype):
    q, k, v = (_rand(1, 2, 40, 16, seed=s, dtype=dtype) for s in (1, 2, 3))
    out = qt.flex_attention(q, k, v, lambda s, b, h, i, j: s * 0.5, t_block_mask(_causal, None, None, 40, 40,
                                                                                 device="cpu"))
    assert out.dtype == dtype
    want = _dense(q.double(), k.double(), v.double(), lambda s, b, h, i, j: s * 0.5, _causal)[0]
    _close(out, want, 1e-2, "out")
    assert all(g.dtype == dtype for g in _grads(out, [q, k, v]))
    out = qt.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == dtype
    _close(out, torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                 is_causal=True), 1e-2, "sdpa")


# ============================================================================================= refusals
def test_tensors_off_the_cpu_are_refused_naming_torchs_function():
    q = torch.empty(1, 2, 8, 4, device="meta")
    with pytest.raises(ValueError, match=r"query: qkv.torch computes on the CPU, got a tensor on meta; use "
                                         r"torch.nn.attention.flex_attention.flex_attention there"):
        qt.flex_attention(q, q, q)
    with pytest.raises(ValueError, match=r"query: .* use torch.nn.functional.scaled_dot_product_attention there"):
        qt.scaled_dot_product_attention(q, q, q)


def test_bad_inputs_name_the_argument():
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(TypeError, match=r"query: expected a torch.Tensor, got ndarray"):
        qt.flex_attention(q.numpy(), q, q)
    with pytest.raises(TypeError, match=r"key: expected dtype torch.float32 \(as query\), got torch.float64"):
        qt.flex_attention(q, q.double(), q)
    with pytest.raises(TypeError, match=r"query: expected dtype float16, bfloat16, float32 or float64, got torch.int"):
        qt.scaled_dot_product_attention(q.int(), q, q)
    with pytest.raises(TypeError, match=r"block_mask: expected a BlockMask .*, got function"):
        qt.flex_attention(q, q, q, block_mask=_causal)
    with pytest.raises(ValueError, match=r"block_mask: built for Q_LEN=16, KV_LEN=16, but the query has L=8"):
        qt.flex_attention(q, q, q, block_mask=t_block_mask(_causal, None, None, 16, 16, device="cpu"))
    with pytest.raises(TypeError, match=r"score_mod: expected .*, got MaskMod"):
        qt.flex_attention(q, q, q, mods.causal())
    with pytest.raises(TypeError, match=r"score_mod: expected bad to return a torch tensor of scores \(as torch's flex_attention does\), got str"):
        def bad(score, b, h, q_idx, kv_idx):
            return "no"
        qt.flex_attention(q, q, q, bad)
    with pytest.raises(ValueError, match=r"dropout_p: expected a number in \[0, 1\], got 2"):
        qt.scaled_dot_product_attention(q, q, q, dropout_p=2)


def test_a_vjp_that_returns_the_wrong_shape_is_named():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 8, 4))
    mod = mods.ScoreMod(lambda s, b, h, i, j: s * 2, vjp=lambda s, b, h, i, j, ds: ds[..., :1] * 2)
    with pytest.raises(ValueError, match=r"score_mod: its vjp returned shape .*, expected the block's shape"):
        qkv.flex_attention_backward(np.ones((2, 8, 4)), q, q, q, mod)


def test_compose_chains_a_vjp_with_a_built_in_derivative():
    """compose(ScoreMod(fn, vjp=…), softcap) differentiates as compose(ScoreMod(fn, grad=…), softcap), on the
    reference and the tiled backward."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 300, 8)) * 2 for _ in range(3))
    do = rng.standard_normal((2, 300, 8))

    def fn(s, b, h, i, j):
        return np.where(j > i, s * 0.5, s + 0.1 * h)
    by_grad = mods.ScoreMod(fn, grad=lambda s, b, h, i, j: np.where(j > i, 0.5, 1.0))
    by_vjp = mods.ScoreMod(fn, vjp=lambda s, b, h, i, j, ds: ds * np.where(j > i, 0.5, 1.0))
    composed = mods.compose(by_vjp, mods.softcap(3.0))
    assert composed.has_grad and composed.has_vjp
    for backend in ("reference", "tiled"):
        want = qkv.flex_attention_backward(do, q, k, v, mods.compose(by_grad, mods.softcap(3.0)), backend=backend)
        got = qkv.flex_attention_backward(do, q, k, v, composed, backend=backend)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_import_qkv_does_not_import_torch_and_a_missing_torch_names_the_extra():
    code = "import sys, qkv; assert 'torch' not in sys.modules; import qkv.torch; print(qkv.torch.__name__)"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "qkv.integrations.torch", got.stderr
    code = "import sys; sys.modules['torch'] = None; import qkv; qkv.torch"      # torch missing
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert got.returncode == 1 and got.stderr.strip().endswith(
        "ImportError: qkv.torch needs torch: pip install 'qkv[torch]'"), got.stderr


# ============================================================================================= training
def test_a_few_steps_of_training_a_windowed_biased_attention_lower_the_loss():
    """A sliding window and a learnable relative-position bias, trained by Adam to copy the value two positions
    back: the bias and the projections learn, and the loss falls."""
    g = torch.Generator().manual_seed(0)
    Lt, D = 64, 16
    x = torch.randn(4, Lt, D, generator=g)
    target = torch.roll(x, 2, dims=1)
    wq, wk = (torch.nn.Parameter(torch.randn(D, D, generator=g) * 0.1) for _ in range(2))
    bias = torch.nn.Parameter(torch.zeros(2, 16))

    def rel(score, b, h, q_idx, kv_idx):
        return score + bias[h, (q_idx - kv_idx).clamp(0, 15)]
    bm = t_block_mask(_window(8), None, None, Lt, Lt, device="cpu", BLOCK_SIZE=16)
    opt = torch.optim.Adam([wq, wk, bias], lr=0.1)
    losses = []
    for _ in range(8):
        q = (x @ wq).view(4, Lt, 2, 8).transpose(1, 2)              # (B, H, L, E)
        k = (x @ wk).view(4, Lt, 2, 8).transpose(1, 2)
        v = x.view(4, Lt, 2, 8).transpose(1, 2)
        out = qt.flex_attention(q, k, v, rel, bm).transpose(1, 2).reshape(4, Lt, D)
        loss = ((out - target)[:, 2:] ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert bias.grad is not None and bias.grad.abs().max() > 0
    assert losses[-1] < 0.7 * losses[0], losses
