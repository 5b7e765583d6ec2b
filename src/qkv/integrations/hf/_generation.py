"""What :func:`qkv.hf.record` adds for generation: every call's last query row stacked into ``rec.generation``,
the generated ids (``rec.tokens``) from the model's ``generate``, and qkv's own decoder
(:class:`qkv.models.llama.LlamaModel`) reporting its layers to the same :class:`~qkv.hf._record.Recording`.

A generation is one call of every layer per new token: the prompt's call (L = P queries over P keys) makes token
0, the call of token t − 1 (one query) makes token t. The query that made a token is its call's last row, so each
call keeps that row alone, (B, heads, S) — O(S) memory per step, never the L × S weights of a call — and
``rec.generation[layer]`` stacks them, (B, heads, new_tokens, S_total), S_total = P + new_tokens − 1 (a static
cache: its length). Key j of row t is key j of that call as transformers' ``out.attentions[t][layer]`` counts
it: where a layer's cache keeps only a sliding window (Mistral, Gemma 2's local layers), the window's keys, the
first of them token ``rec.key_offsets[layer][t]`` (``rec.generation_by_position`` puts them there). Beam search
records its beams' rows as they ran, B × num_beams of them.

Nothing here imports torch: ``record`` of qkv's decoder runs on NumPy alone.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from qkv.core import mods


def stack_rows(rows: list, offsets: np.ndarray, *, by_position: bool = False) -> np.ndarray:
    """Each call's row (B, h, S_t) → (B, h, N, S_total) float32, S_total = max(offsets[t] + S_t) (P + N − 1 for a
    decoder's self-attention, a window's dropped keys counted): row t at columns 0 … S_t − 1 (the call's keys, as
    transformers counts them), or with ``by_position`` at its tokens' positions offsets[t] … offsets[t] + S_t − 1;
    0 elsewhere. ValueError where the calls' batch or heads differ (two batches in one block)."""
    shapes = {r.shape[:2] for r in rows}
    if len(shapes) > 1:
        raise ValueError(f"generation: the calls of one layer had (batch, heads) {sorted(shapes)}; record one "
                         f"generate or one batch per block")
    B, h = rows[0].shape[:2]
    width = max(int(o) + r.shape[-1] for o, r in zip(offsets, rows))
    out = np.zeros((B, h, len(rows), width), np.float32)
    for t, r in enumerate(rows):
        start = int(offsets[t]) if by_position else 0
        out[:, :, t, start:start + r.shape[-1]] = r
    return out


def key_offsets(first: tuple, widths: list) -> np.ndarray:
    """The token position of each row's key 0 (N,) int64: 0, unless the layer's cache dropped the keys before a
    sliding window. ``first``: (L, S) of the first call; ``widths``: every call's S. A self-attention over the
    prompt (L = S) puts call t's last key at token S₀ − 1 + t (its own token), so its key 0 is S₀ + t − S_t;
    anything else (cross-attention, a static cache's slots) is counted from 0."""
    L0, S0 = first
    t = np.arange(len(widths))
    if L0 != S0:
        return np.zeros(len(widths), np.int64)
    return np.maximum(0, S0 + t - np.asarray(widths)).astype(np.int64)


# --------------------------------------------------------------------------------------- generate's ids
def new_tokens(model, out, args: tuple, kwargs: dict) -> np.ndarray | None:
    """The ids ``model.generate(*args, **kwargs)`` added, (B, N) int64, from what it returned: a tensor or an
    output with ``sequences`` (transformers; the prompt's ids, or a decoder-start token, dropped), or a
    :class:`qkv.models.Generation` (``ids``). None for anything else."""
    if hasattr(out, "ids") and hasattr(out, "prompt_ids"):                      # qkv.models' Generation
        return np.asarray([list(out.ids)], dtype=np.int64).reshape(1, -1)
    seq = getattr(out, "sequences", out)
    if not hasattr(seq, "detach") or getattr(seq, "ndim", 0) != 2:
        return None
    seq = seq.detach().cpu().numpy().astype(np.int64)
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        start = kwargs.get("decoder_input_ids")
        start = 1 if start is None else int(start.shape[-1])                   # decoder_start_token_id
    else:
        ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
        start = int(ids.shape[-1]) if getattr(ids, "ndim", 0) == 2 and not ids.dtype.is_floating_point else 0
    return seq[:, start:]


@contextlib.contextmanager
def generate_wrapped(model, rec):
    """``model.generate`` (an instance attribute for the block, removed after) hands its result's new ids to
    ``rec.tokens``; whatever ``generate`` the instance had is back after the block. A model without
    ``generate`` (an encoder) is left as it is."""
    inner = getattr(model, "generate", None)
    if not callable(inner):
        yield
        return
    had = "generate" in vars(model)
    before = vars(model).get("generate")

    def generate(*args, **kwargs):
        out = inner(*args, **kwargs)
        rec.tokens = new_tokens(model, out, args, kwargs)
        return out
    generate.__doc__ = getattr(inner, "__doc__", None)
    object.__setattr__(model, "generate", generate)
    try:
        yield
    finally:
        if had:
            object.__setattr__(model, "generate", before)
        else:
            object.__delattr__(model, "generate")


# --------------------------------------------------------------------------------------- qkv's decoder
def decoder_spec(q: np.ndarray, k: np.ndarray, key_mask):
    """The :class:`~qkv.hf._attention.Spec` of one layer call of qkv's decoder: q (B, H, L, E), k (B, Hk, S, E),
    the queries the last L of the S keys (causal, bottom-right), padding keys where ``key_mask`` (B, S) is False,
    scale 1/√E, no soft-capping, no sinks."""
    from qkv.integrations.hf._attention import Spec
    from qkv.integrations.hf._mask import Mask, _padding_mod, _window

    B, H, L, E = q.shape
    S = k.shape[2]
    spec = Spec()
    spec.scale, spec.enable_gqa = E ** -0.5, k.shape[1] != H
    spec.score_mod, spec.sinks, spec.dense, spec.mask = None, None, None, None
    mod = _window(0, math.inf, S - L) if L > 1 else None                  # one query: its row sees every key
    padded = key_mask is not None and not np.asarray(key_mask).all()
    if padded:
        pad = _padding_mod(np.asarray(key_mask, dtype=bool).reshape(B, S))
        mod = pad if mod is None else mods.and_masks(mod, pad)
    if mod is not None:
        spec.mask = Mask(mod, B, L, S, per_batch=padded)
    return spec


@contextlib.contextmanager
def decoder_observed(model, rec):
    """qkv's decoder (``model.attention_observer``) reports each layer call to ``rec`` inside the block."""
    def observer(layer, q, k, v, key_mask):
        rec.observe_arrays(int(layer), decoder_spec(q, k, key_mask), q, k, v)
    had = "attention_observer" in vars(model)
    before = vars(model).get("attention_observer")
    model.attention_observer = observer
    try:
        yield
    finally:
        if had:
            model.attention_observer = before
        else:
            del model.attention_observer
