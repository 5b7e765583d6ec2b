"""The tests of tests/unit/test_matrix.py that need torch or transformers."""

import numpy as np
import pytest

from qkv import accuracy as A
from test_matrix import _limits, _plans_proven, _spec  # noqa: E402,F401  (its helpers, shared)


# ============================================================================== the reference against torch
#: Problems for the reference's own check: every kind of score mod, mask and sink, grouped heads, a broadcast
#: key/value batch, L ≠ S and rows that may attend to nothing.
REFERENCE_CHECKS = [
    _spec(api="sdpa", dtype="float64", lead=(2, 4), kv_heads=2, kv_batch_one=True, L=7, S=11),
    _spec(api="sdpa", dtype="float64", mask="bool", mask_full=True, lead=(3,), L=9, S=5),
    _spec(api="sdpa", dtype="float64", mask="float", L=6, S=13, scale=0.5),
    _spec(api="sdpa", dtype="float64", mask="causal_bottom_right", L=12, S=5),
    _spec(api="flex", dtype="float64", mask_mod="causal", score_mod="alibi", lead=(2, 3), L=10, S=10),
    _spec(api="flex", dtype="float64", score_mod="softcap", cap=1.0, sinks=True, amp=3.0, L=8, S=9),
    _spec(api="flex", dtype="float64", mask_mod="document", mod_arg=3, score_mod="alibi_softcap", cap=2.0,
          lead=(2, 2), L=12, S=12),
    _spec(api="flex", dtype="float64", mask_mod="sliding_window", mod_arg=3, score_mod="custom_grad", L=9, S=9),
    _spec(api="flex", dtype="float64", mask_mod="sliding_window", mod_arg=3, score_mod="custom_vjp", L=9, S=9),
    _spec(api="flex", dtype="float64", mask_mod="custom_rows", score_mod="custom_inf", sinks=True, L=11, S=11),
    _spec(api="flex", dtype="float64", mask_mod="custom_head", lead=(3,), kv_heads=1, sinks=True, L=6, S=8),
    _spec(api="flex", dtype="float64", mask_mod="document_batch", mod_arg=3, lead=(2, 2), score_mod="custom",
          L=10, S=10),
]


def _torch_dense(torch, p):
    """The spec's attention in float64 torch, autograd through it: (out, lse, [dq, dk, dv, dsink])."""
    spec = p.spec
    tq, tk, tv = (torch.from_numpy(a.astype(np.float64)).requires_grad_() for a in (p.q, p.k, p.v))
    k, v = tk, tv
    if p.rep > 1:
        k, v = k.repeat_interleave(p.rep, dim=-3), v.repeat_interleave(p.rep, dim=-3)
    k, v = k.expand(p.lead + k.shape[-2:]), v.expand(p.lead + v.shape[-2:])
    s = tq @ k.transpose(-1, -2) * p.scale
    L, S = spec.L, spec.S
    h = torch.arange(p.lead[-1]).view(-1, 1, 1) if p.lead else torch.zeros((), dtype=torch.int64)
    i, j = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
    if spec.score_mod.startswith("custom"):                                   # 0.1·h in float64, not float32
        h, i, j = h.double(), i.double(), j.double()
    if spec.score_mod != "none":
        s = _torch_mod(torch, p, s, h, i, j)
    if p.bias is not None:
        s = s + torch.from_numpy(p.bias.astype(np.float64))
    if p.allowed is not None:
        s = s.masked_fill(~torch.from_numpy(np.broadcast_to(p.allowed, s.shape).copy()), float("-inf"))
    ts = None
    if p.sink_logits is not None:
        ts = torch.from_numpy(p.sink_logits.astype(np.float64)).requires_grad_()
        col = (ts.view(-1, 1, 1) if p.lead else ts.view(1, 1)).expand(s.shape[:-1] + (1,))
        s = torch.cat([s, col], dim=-1)
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    out = (e / torch.where(total == 0, torch.ones_like(total), total))[..., :S] @ v
    lse = (m + torch.log(total)).squeeze(-1)
    out.backward(torch.from_numpy(p.grad_out.astype(np.float64)))
    grads = [tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy(), None if ts is None else ts.grad.numpy()]
    return out.detach().numpy(), lse.detach().numpy(), grads


def _torch_mod(torch, p, s, h, i, j):
    spec, cap = p.spec, p.spec.cap
    if spec.score_mod in ("alibi", "alibi_softcap"):
        mod = p.score_mod if spec.score_mod == "alibi" else p.score_mod.params["mods"][0]
        s = s + torch.from_numpy(mod.params["slopes"])[h] * (j - i)
        return s if spec.score_mod == "alibi" else cap * torch.tanh(s / cap)
    if spec.score_mod == "softcap":
        return cap * torch.tanh(s / cap)
    if spec.score_mod in ("custom_grad", "custom_vjp"):
        return torch.where(j > i, s * 0.5, s + 0.1 * h)
    if spec.score_mod == "custom_inf":
        return torch.where((i - j) % 4 == 3, torch.full_like(s, float("-inf")), s * 1.25)
    return s - 0.02 * (i - j).abs() + 0.1 * h                                  # custom


@pytest.mark.torch
@pytest.mark.parametrize("spec", REFERENCE_CHECKS, ids=lambda s: f"{s.api}-{s.mask}-{s.mask_mod}-{s.score_mod}")
def test_the_reference_is_torch_float64_autograd(spec):
    """``qkv.accuracy.reference`` (output, lse, every gradient) against torch's float64 autograd through the same
    formula, to 1e-10; its masks equal the block mask's own (``BlockMask.dense``); and where torch's SDPA takes
    the problem, the output equals SDPA's."""
    torch = pytest.importorskip("torch")
    p = A.build(spec)
    ref = A.reference(p)
    out, lse, grads = _torch_dense(torch, p)
    np.testing.assert_allclose(ref["out"], out, atol=1e-10, rtol=1e-10)
    np.testing.assert_allclose(ref["lse"], lse, atol=1e-10, rtol=1e-10)
    for name, g in zip(("dq", "dk", "dv", "dsink"), grads):
        if ref[name] is not None:
            np.testing.assert_allclose(ref[name], g, atol=1e-10, rtol=1e-10, err_msg=name)
    assert (ref["dq"] is None) == (spec.score_mod == "custom")
    full = p.lead + (spec.L, spec.S)
    if p.block_mask is not None:
        dense = np.broadcast_to(p.block_mask.dense(p.lead, spec.L, spec.S), full)
        np.testing.assert_array_equal(np.broadcast_to(p.allowed, full), dense)
    if spec.api == "sdpa":
        tq, tk, tv = (torch.from_numpy(a.astype(np.float64)) for a in (p.q, p.k, p.v))
        if len(p.lead) == 2:                                                  # a key/value batch of 1
            tk, tv = tk.expand(p.lead[:1] + tk.shape[1:]), tv.expand(p.lead[:1] + tv.shape[1:])
        mask = None if p.attn_mask is None else torch.from_numpy(p.attn_mask.astype(
            bool if p.attn_mask.dtype == bool else np.float64))
        want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, scale=p.scale,
                                                                enable_gqa=p.enable_gqa).numpy()
        live = np.isfinite(ref["lse"])[..., None]
        np.testing.assert_allclose(np.where(live, ref["out"], 0), np.where(live, want, 0), atol=1e-10, rtol=1e-10)
