"""A local transformers model folder on qkv, with the interface ``qkv model`` and ``qkv view`` read.

:func:`load` reads a folder holding ``config.json``, safetensors weights and a tokenizer — nothing is downloaded
(``local_files_only=True``) — and returns a :class:`Model`: ``run(texts)`` (every layer's attention weights, as
:func:`qkv.hf.record` kept them), ``tokenize(text)``, ``trace_layer(text, layer)`` (one layer's attention through
qkv's pipeline, every head, a :class:`qkv.Trace`), and ``config`` (layers, heads, key/value heads, name). A
decoder (``…ForCausalLM``, ``GPT2LMHeadModel``) is causal; an encoder (BERT-like) is not.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import numpy as np

from qkv.integrations.hf._folder import check_folder


@dataclass
class Config:
    """What the commands read of a model's configuration.

    Attributes:
        name: the folder's name (or the config's ``_name_or_path``).
        path: the folder.
        num_layers, num_heads, num_kv_heads: layers, query heads, key/value heads.
        decoder: True for a causal language model.
        context_length: the most tokens it takes (``max_position_embeddings``).
        rope_theta: RoPE's base (0.0 when the model has none).
        model_type: the config's ``model_type`` (``llama``, ``bert``, …).
    """
    name: str
    path: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    decoder: bool
    context_length: int
    rope_theta: float = 0.0
    model_type: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def group_size(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def kv_head(self, head: int) -> int:
        """The key/value head that query head ``head`` reads."""
        return head // self.group_size


@dataclass
class Output:
    """``Model.run``'s result, shaped as qkv's model outputs (``qkv.viz.show`` and ``head_kinds`` take it).

    Attributes:
        tokens: per text, its tokens as shown (a decoder's decoded one by one).
        input_ids: (B, T) int64; attention_mask: (B, T) bool, True = real token.
        attentions: per layer (B, H, T, T) float32, the weights qkv computed.
        logits: (B, T, vocab) float32 for a decoder, None for an encoder.
    """
    tokens: list
    input_ids: np.ndarray
    attention_mask: np.ndarray
    attentions: list
    logits: np.ndarray | None = None


class _Tokenizer:
    """The tokenizer's normalizer as ``qkv model`` asks for it (``model.tokenizer.normalizer``)."""

    def __init__(self, tok):
        backend = getattr(tok, "backend_tokenizer", None)
        self.normalizer = getattr(backend, "normalizer", None)


class Model:
    """A transformers model on qkv (see the module): ``run``, ``tokenize``, ``trace_layer``, ``config``."""

    def __init__(self, model, tokenizer, config: Config):
        self.model, self.hf_tokenizer, self.config = model, tokenizer, config
        self.tokenizer = _Tokenizer(tokenizer)

    def _ids(self, texts) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (B, T) and the padding mask (B, T) of ``texts``, truncated to the context with a warning."""
        enc = self.hf_tokenizer(list(texts), padding=True, return_tensors="np", truncation=False)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        mask = np.asarray(enc.get("attention_mask", np.ones_like(ids)), dtype=bool)
        n = self.config.context_length
        if ids.shape[1] > n:
            warnings.warn(f"text: {ids.shape[1]} tokens, truncated to the model's {n} positions", UserWarning,
                          stacklevel=3)
            ids, mask = ids[:, :n], mask[:, :n]
        return ids, mask

    def _shown(self, ids) -> list[str]:
        if self.config.decoder:
            return [self.hf_tokenizer.decode([int(i)]) for i in ids]
        return [str(t) for t in self.hf_tokenizer.convert_ids_to_tokens([int(i) for i in ids])]

    def tokenize(self, text: str) -> list[str]:
        """The tokens of ``text`` as the model reads them (special tokens included; a decoder's decoded)."""
        ids, _ = self._ids([text])
        return self._shown(ids[0])

    def _forward(self, ids, mask, recording):
        import torch

        from qkv.integrations.hf._state import ACTIVE
        token = ACTIVE.set(recording)
        try:
            with torch.no_grad():
                return self.model(input_ids=torch.from_numpy(ids),
                                  attention_mask=torch.from_numpy(mask.astype(np.int64)))
        finally:
            ACTIVE.reset(token)

    def run(self, texts) -> Output:
        """Every layer's attention weights (and a decoder's logits) for ``texts`` (a str or a list of str)."""
        from qkv.integrations.hf._record import Recording

        texts = [texts] if isinstance(texts, str) else list(texts)
        ids, mask = self._ids(texts)
        rec = Recording(model=self.model)
        out = self._forward(ids, mask, rec)
        tokens = [self._shown(row[m]) for row, m in zip(ids, mask)]
        logits = getattr(out, "logits", None) if self.config.decoder else None
        return Output(tokens=tokens, input_ids=ids, attention_mask=mask,
                      attentions=[rec.weights[i] for i in rec.layers],
                      logits=None if logits is None else logits.float().numpy())

    def trace_layer(self, text: str, layer: int):
        """Layer ``layer``'s attention for ``text`` through qkv's pipeline, every head: a :class:`qkv.Trace`
        (``Q``, ``K`` after the positions, ``V``, ``scores``, ``scaled``, …, ``weights`` (1, H, T, T), ``output``)."""
        from qkv.integrations.hf._record import Recording

        n = self.config.num_layers
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < n:
            raise ValueError(f"layer: expected an integer in 0..{n - 1} (the model has {n} layers), got {layer!r}")
        ids, mask = self._ids([text])
        rec = Recording(layers=[int(layer)], model=self.model, trace_all=True)
        self._forward(ids, mask, rec)
        return rec.traces[int(layer)]


#: The class-name endings of a causal language model in a config's ``architectures``: ``LlamaForCausalLM`` and the
#: like, and the older ``…LMHeadModel`` (GPT-2's ``GPT2LMHeadModel``, which ``…ForCausalLM`` alone missed).
_CAUSAL_LM = ("ForCausalLM", "LMHeadModel")


def load(path, *, dtype=None) -> Model:
    """The model in folder ``path`` on qkv (``attn_implementation="qkv"``), in evaluation mode, float32 unless
    ``dtype`` (a torch dtype) says otherwise.

    Raises:
        ValueError naming ``path``: no such folder, no config.json, no safetensors, a config transformers does
        not know, or no tokenizer in the folder. ImportError when torch or transformers is missing.
    """
    path = check_folder(path)                                # before torch and transformers: see _folder
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer
    import torch

    from qkv.integrations.hf._register import register

    name = register()
    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError) as exc:
        raise ValueError(f"path: {path!r}: transformers cannot read its config.json ({_first_line(exc)})") from None
    decoder = any(a.endswith(_CAUSAL_LM) for a in (getattr(hf_config, "architectures", None) or []))
    cls = AutoModelForCausalLM if decoder else AutoModel
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError, TypeError) as exc:
        raise ValueError(f"path: {path!r} has no tokenizer qkv can load ({_first_line(exc)})") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    from safetensors import SafetensorError
    try:
        model = cls.from_pretrained(path, local_files_only=True, attn_implementation=name, use_safetensors=True,
                                    dtype=dtype or torch.float32).eval()     # (never a pickle, whatever is there)
    except (ValueError, OSError, SafetensorError) as exc:
        raise ValueError(f"path: {path!r}: transformers cannot load its weights ({_first_line(exc)})") from None
    return Model(model, tokenizer, _config(hf_config, path, decoder))


def _first_line(exc) -> str:
    return " ".join(str(exc).split())[:200]


def _config(c, path: str, decoder: bool) -> Config:
    heads = int(c.num_attention_heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta if theta is not None else getattr(c, "rope_theta", 0.0)
    return Config(name=os.path.basename(os.path.normpath(path)), path=path, num_layers=int(c.num_hidden_layers),
                  num_heads=heads, num_kv_heads=kv, decoder=decoder,
                  context_length=int(getattr(c, "max_position_embeddings", 512) or 512),
                  rope_theta=float(theta or 0.0), model_type=str(getattr(c, "model_type", "")))
