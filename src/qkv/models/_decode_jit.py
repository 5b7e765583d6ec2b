"""One decoding step of a Llama model in compiled code: a token through every layer and the LM head in one
call, without the interpreter between the steps (issue 43, part 2).

Per layer, as :meth:`qkv.models.llama.LlamaModel._decode` computes it for one row: RMSNorm, x · [W_Q W_K W_V]
(the weights as the file stores them: :func:`qkv.models._quant_jit.matvec_par`), RoPE on Q and K
(:func:`qkv.compute._jit.rope_rows`, bit for bit), K and V into the layer's cache, the attention of each query
head over the cache (:func:`qkv.compute.kv_decode.step_kernels`: the cache's rows read as stored, runs of
keys merged by their maxima, the tasks on numba's threads), · W_O,
+ x, RMSNorm, x · [W_gate W_up], SwiGLU (:func:`qkv.compute._jit.swiglu_rows`), · W_down, + residual; then
the final RMSNorm and the LM head. The norms, RoPE and SwiGLU are the engine's own compiled kernels, the
matrix–vector products the quantized weights' kernels, the attention and the cache's stores the cache's own
(the same ones the row-wise path runs for a quantized cache).

Built once per kernel module, activations and cache format (:func:`build`), for one sequence (B = 1) and a
float32, float16 or int8 cache. The model takes
this path where it applies (:meth:`~qkv.models.llama.LlamaModel.step` with one token, weights as stored, one
type per kind of matrix across the layers); tests hold it to the row-wise path.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit

from qkv.compute import kv_decode
from qkv.models import _quant_jit, _quant_q8

_F = np.float32


@functools.cache
def build(jit, q8: bool = False, kv: str = "f32"):
    """The step, compiled against the engine's kernel module ``jit`` (:mod:`qkv.compute._jit`); ``q8``: Q4_1
    and Q8_0 products with 8-bit activations (:mod:`qkv.models._quant_q8`, ``load_llama(activations="int8")``);
    ``kv``: the caches' storage, ``"f32"``, ``"f16"`` or ``"int8"`` (:mod:`qkv.core.kv_quant`)."""
    return assemble(products(q8), *kv_decode.step_kernels(kv), jit.rms_norm_rows, jit.rope_rows, jit.swiglu_rows)


@functools.cache
def products(q8: bool):
    """The step's matrix–vector products: ``matvec(kind, block, data, x, out, chunks)``, the blocks' float32
    kernel, or with ``q8`` the 8-bit activations' for Q4_1 and Q8_0."""
    matvec_f, matvec_q8, q8_kinds = _quant_jit.matvec_par, _quant_q8.matvec_q8, _quant_q8.KINDS

    @njit
    def matvec(kind, bs, w, x, out, chunks):
        if q8 and (kind == q8_kinds[0] or kind == q8_kinds[1]):      # Q4_1, Q8_0: 8-bit activations
            matvec_q8(kind, w, x, out, chunks)
        else:
            matvec_f(kind, bs, w, x, out, chunks)
    return matvec


def assemble(matvec, decode, store, rms, rope, swiglu):
    """The step from its parts (numba functions): :func:`build`'s, or stand-ins that do nothing, for
    ``benchmarks/decode_parts.py``'s measure of where a step's time goes."""
    @njit
    def step(x, pos, cos, sin, dims, kinds, eps, scale, chunks, parts, attn_norm, ffn_norm, w_qkv, w_o, w_gu,
             w_down, ks, vs, kss, vss, bw, norm, w_head, logits):
        """x (1, D) float32, the token's embedding, overwritten by the layers' output; pos its position; cos,
        sin (1, E/2) its rotation; dims (H, Hk, E, F); kinds ((kind, block) of qkv, o, gate|up, down, head);
        ks, vs per layer the cache's storage (1, Hk, ≥ pos + 1, E) with room at pos, kss, vss its scales (int8;
        else placeholders), ``bw`` numbers a scale; ``parts`` runs of keys per head; logits (1, V) written.
        Returns 0, or 2·layer + 1 (+ 1 for the value) where a new row does not fit the cache's format."""
        H, Hk, E, F = dims
        D = x.shape[1]
        h = np.empty((1, D), _F)
        qkv = np.empty((1, (H + 2 * Hk) * E), _F)
        qs = np.empty((1, H, 1, E), _F)
        att = np.empty((1, H, 1, E), _F)
        o = np.empty((1, D), _F)
        gu = np.empty((1, 2 * F), _F)
        for layer in range(len(ks)):
            rms(x, attn_norm[layer], eps, h)
            matvec(kinds[0][0], kinds[0][1], w_qkv[layer], h, qkv, chunks)
            rope(qkv, H + Hk, E, cos, sin)
            kc, vc, kq, vq = ks[layer], vs[layer], kss[layer], vss[layer]
            for g in range(Hk):
                if not store(qkv[0, (H + g) * E:(H + g + 1) * E], kc[0, g, pos], kq[0, g, pos], bw):
                    return 2 * layer + 1
                if not store(qkv[0, (H + Hk + g) * E:(H + Hk + g + 1) * E], vc[0, g, pos], vq[0, g, pos], bw):
                    return 2 * layer + 2
            for i in range(H):
                for e in range(E):
                    qs[0, i, 0, e] = qkv[0, i * E + e] * scale
            decode(qs, kc, vc, kq, vq, pos + 1, att, bw, parts)
            matvec(kinds[1][0], kinds[1][1], w_o[layer], att.reshape(1, H * E), o, chunks)
            x += o
            rms(x, ffn_norm[layer], eps, h)
            matvec(kinds[2][0], kinds[2][1], w_gu[layer], h, gu, chunks)
            swiglu(gu, F)
            matvec(kinds[3][0], kinds[3][1], w_down[layer], gu[:, :F].copy(), o, chunks)
            x += o
        rms(x, norm, eps, h)
        matvec(kinds[4][0], kinds[4][1], w_head, h, logits, chunks)
        return 0

    return step
