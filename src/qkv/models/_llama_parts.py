"""The parts of a Llama model that loading builds and the model runs: :class:`LlamaConfig` (the file's
architecture) and one decoder layer's weights (``_Layer``). Kept apart from :mod:`qkv.models.llama` so that the
loader (:mod:`qkv.models._llama_load`) and the model import them without importing each other."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from qkv.core.positions import RoPE
from qkv.models._quant import QuantMatrix
from qkv.nn.mha import MultiHeadAttention


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture, from the GGUF file's metadata (``llama.*`` and ``tokenizer.ggml.*`` keys)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    vocab_size: int
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    tie_word_embeddings: bool = True
    #: tensor type name → number of tensors (e.g. {"Q4_1": 210, "F32": 61, "Q8_0": 1})
    tensor_types: dict = field(default_factory=dict)
    name: str = ""
    path: str = ""

    @property
    def head_dim(self) -> int:
        """E, the width of one head's queries, keys and values."""
        return self.hidden_size // self.num_heads

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (3 for SmolLM2-135M: heads 0–2 share key/value head 0, …)."""
        return self.num_heads // self.num_kv_heads

    def kv_head(self, head: int) -> int:
        """The key/value head that query head ``head`` reads (grouped-query attention)."""
        return head // self.group_size



@dataclass
class _Layer:
    """One decoder layer's weights. Each projection is float32 in qkv's (in, out) layout, or as the file stores
    it (a :class:`~qkv.models._quant.QuantMatrix` (out, in)); :func:`~qkv.models._quant.matmul` multiplies
    either."""

    attn_norm: np.ndarray     # (D,)
    ffn_norm: np.ndarray      # (D,)
    w_qkv: np.ndarray | QuantMatrix     # (D, (H + 2·Hk)·E): [W_Q | W_K | W_V], one matmul on the decoding path
    w_o: np.ndarray | QuantMatrix       # (H·E, D)
    w_gate_up: np.ndarray | QuantMatrix  # (D, 2F): [W_gate | W_up], one matmul
    w_down: np.ndarray | QuantMatrix    # (F, D)
    heads: tuple              # (D, H, Hk, E)
    rope: RoPE
    #: float32 weights: W_Q, W_K, W_V views of w_qkv, W_O w_o; quantized: None until :attr:`attention` builds it
    mha: MultiHeadAttention | None = None

    @property
    def attention(self) -> MultiHeadAttention:
        """The layer's :class:`~qkv.MultiHeadAttention` (for the traced path and the explainer); with quantized
        weights, built from them dequantized when first asked for (and kept: 3.5 MB a layer for SmolLM2)."""
        if self.mha is None:
            D, H, Hk, E = self.heads
            w = [_float32(self.w_qkv), _float32(self.w_o)]
            mha = MultiHeadAttention(D, H, num_kv_heads=Hk, bias=False, rope=self.rope, dtype=np.float32)
            mha.W_Q, mha.W_K, mha.W_V = w[0][:, :H * E], w[0][:, H * E:(H + Hk) * E], w[0][:, (H + Hk) * E:]
            mha.W_O = w[1]
            self.mha = mha
        return self.mha


def _float32(w) -> np.ndarray:
    """A projection's weight in qkv's (in, out) float32 layout (a QuantMatrix dequantized and transposed)."""
    return w if isinstance(w, np.ndarray) else np.ascontiguousarray(w.dequantize().T)
