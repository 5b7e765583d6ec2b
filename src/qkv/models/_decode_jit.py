"""One decoding step of a Llama model in compiled code: a token through every layer and the LM head in one
call, without the interpreter between the steps (issue 43, part 2).

Per layer, as :meth:`qkv.models.llama.LlamaModel._decode` computes it for one row: RMSNorm, x · [W_Q W_K W_V]
(the weights as the file stores them: :func:`qkv.models._quant_jit.matvec_par`), RoPE on Q and K
(:func:`qkv.compute._jit.rope_rows`, bit for bit), K and V into the layer's cache, the attention of each query
head over the cache (:func:`_attend`, float32 with the row's maximum subtracted, one head a thread), · W_O,
+ x, RMSNorm, x · [W_gate W_up], SwiGLU (:func:`qkv.compute._jit.swiglu_rows`), · W_down, + residual; then
the final RMSNorm and the LM head. The norms, RoPE and SwiGLU are the engine's own compiled kernels, the
matrix–vector products the quantized weights' kernels: only the attention's loop is written here.

Built once per kernel module (:func:`build`), for one sequence (B = 1) and a float32 cache. The model takes
this path where it applies (:meth:`~qkv.models.llama.LlamaModel.step` with one token, weights as stored, one
type per kind of matrix across the layers); tests hold it to the row-wise path.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from qkv.models import _quant_jit, _quant_q8

_F = np.float32


@njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True)
def _attend(qkv, kc, vc, n, H, Hk, E, scale, out):
    """out[h·E:(h+1)·E] = softmax(q_h · K_gᵀ · scale) · V_g over the first n cached tokens, for every query head
    h (g = h // (H / Hk) its key/value head); q_h from row 0 of qkv; kc, vc (1, Hk, ≥ n, E) float32.

    Flash-decoding: each key/value head's n keys in ``parts`` runs, a task each (so that Hk = 3 heads keep two
    threads busy); a task reads each key and value row once for the head's G = H / Hk query heads, and keeps
    its runs' maximum, sum and unnormalised output per query head; the runs merge by log-sum-exp. Sums are
    reassociated (vector lanes) and fused: the order of a BLAS dot product, not the row-wise path's."""
    G = H // Hk
    parts = max(1, min(16, n // 512))
    T = Hk * parts
    mx = np.empty((T, G), _F)
    sums = np.empty((T, G), _F)
    acc = np.zeros((T, G, E), _F)
    for t in prange(T):
        g, c = t // parts, t % parts
        j0, j1 = c * n // parts, (c + 1) * n // parts
        q = np.empty((G, E), _F)
        for r in range(G):
            for e in range(E):
                q[r, e] = qkv[0, (g * G + r) * E + e] * scale
        s = np.empty((G, j1 - j0), _F)
        for j in range(j0, j1):
            k = kc[0, g, j]
            for r in range(G):
                d = _F(0.0)
                for e in range(E):
                    d += q[r, e] * k[e]
                s[r, j - j0] = d
        for r in range(G):
            m = s[r].max()
            total = _F(0.0)
            for j in range(j1 - j0):
                p = np.exp(s[r, j] - m)
                s[r, j] = p
                total += p
            mx[t, r], sums[t, r] = m, total
        for j in range(j0, j1):
            v = vc[0, g, j]
            for r in range(G):
                p = s[r, j - j0]
                for e in range(E):
                    acc[t, r, e] += p * v[e]
    for g in range(Hk):
        for r in range(G):
            m = mx[g * parts, r]
            for c in range(1, parts):
                m = max(m, mx[g * parts + c, r])
            total = _F(0.0)
            o = np.zeros(E, _F)
            for c in range(parts):
                w = np.exp(mx[g * parts + c, r] - m)
                total += sums[g * parts + c, r] * w
                for e in range(E):
                    o[e] += acc[g * parts + c, r, e] * w
            for e in range(E):
                out[0, (g * G + r) * E + e] = o[e] / total


@functools.cache
def build(jit, q8: bool = False):
    """The step, compiled against the engine's kernel module ``jit`` (:mod:`qkv.compute._jit`); ``q8``: Q4_1
    and Q8_0 products with 8-bit activations (:mod:`qkv.models._quant_q8`, ``load_llama(activations="int8")``)."""
    rms, rope, swiglu, matvec_f = jit.rms_norm_rows, jit.rope_rows, jit.swiglu_rows, _quant_jit.matvec_par
    matvec_q8, q8_kinds = _quant_q8.matvec_q8, _quant_q8.KINDS

    @njit
    def matvec(kind, bs, w, x, out, chunks):
        if q8 and (kind == q8_kinds[0] or kind == q8_kinds[1]):      # Q4_1, Q8_0: 8-bit activations
            matvec_q8(kind, w, x, out, chunks)
        else:
            matvec_f(kind, bs, w, x, out, chunks)

    @njit
    def step(x, pos, cos, sin, dims, kinds, eps, scale, chunks, attn_norm, ffn_norm, w_qkv, w_o, w_gu, w_down,
             ks, vs, norm, w_head, logits):
        """x (1, D) float32, the token's embedding, overwritten by the layers' output; pos its position; cos,
        sin (1, E/2) its rotation; dims (H, Hk, E, F); kinds ((kind, block) of qkv, o, gate|up, down, head);
        ks, vs per layer the cache (1, Hk, ≥ pos + 1, E) with room at pos; logits (1, V) written."""
        H, Hk, E, F = dims
        D = x.shape[1]
        h = np.empty((1, D), _F)
        qkv = np.empty((1, (H + 2 * Hk) * E), _F)
        att = np.empty((1, H * E), _F)
        o = np.empty((1, D), _F)
        gu = np.empty((1, 2 * F), _F)
        for layer in range(len(ks)):
            rms(x, attn_norm[layer], eps, h)
            matvec(kinds[0][0], kinds[0][1], w_qkv[layer], h, qkv, chunks)
            rope(qkv, H + Hk, E, cos, sin)
            kc, vc = ks[layer], vs[layer]
            for g in range(Hk):
                for e in range(E):
                    kc[0, g, pos, e] = qkv[0, (H + g) * E + e]
                    vc[0, g, pos, e] = qkv[0, (H + Hk + g) * E + e]
            _attend(qkv, kc, vc, pos + 1, H, Hk, E, scale, att)
            matvec(kinds[1][0], kinds[1][1], w_o[layer], att, o, chunks)
            x += o
            rms(x, ffn_norm[layer], eps, h)
            matvec(kinds[2][0], kinds[2][1], w_gu[layer], h, gu, chunks)
            swiglu(gu, F)
            matvec(kinds[3][0], kinds[3][1], w_down[layer], gu[:, :F].copy(), o, chunks)
            x += o
        rms(x, norm, eps, h)
        matvec(kinds[4][0], kinds[4][1], w_head, h, logits, chunks)

    return step
