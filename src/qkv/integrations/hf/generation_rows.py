"""Generation by a transformers causal model on qkv, and the attention rows of every generated token.

    g = generate(model, "the cat", max_new_tokens=5)           # transformers' model.generate, attention on qkv
    for a in sequence_attentions(model, g.prompt_ids + g.ids):  # per layer (H, T, T): one forward pass
        ...

Why one forward pass gives each step's rows: with a causal mask, query t attends to keys 0 … t and nothing
after, and the keys 0 … t of the full pass are the keys a cached step at position t holds (the same tokens,
positions and layers before it). So row t of the full pass over prompt + continuation is the row token t's own
step computed during generation — the generated token s (0-based) is the query at position P + s, as the page's
generation view shows it. (The last generated token is never fed back into ``generate``; its row is the one it
would have computed.) ``tests/integration/test_viz_hf.py`` holds this against eager's ``generate(…, output_attentions=True,
return_dict_in_generate=True)`` within 1e-6.

The ``prompt`` given here is already what the model reads: a chat template is applied by the caller
(:mod:`qkv.viz.page_hf`, with qkv's sandboxed renderer, never transformers' own).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Generation:
    """What :func:`generate` made.

    Attributes:
        prompt: the text the model read (the chat template already applied).
        prompt_ids: its token ids; ids: the generated ids (the end-of-sequence token included when it came).
        text: the continuation decoded (special tokens left out).
        finish_reason: "eos" (the model ended it) or "length" (max_new_tokens reached).
    """
    prompt: str
    prompt_ids: list
    ids: list
    text: str
    finish_reason: str


def check_decoder(model):
    """``model`` (a :class:`qkv.hf.Model`) when it is a causal language model; ValueError naming ``model``."""
    c = getattr(model, "config", None)
    if not getattr(c, "decoder", False):
        kind = getattr(c, "model_type", "") or type(getattr(model, "model", model)).__name__
        raise ValueError(f"model: expected a causal language model (…ForCausalLM) to generate, got {kind!r}, "
                         f"an encoder: it does not generate")
    return model


def prompt_ids(model, text: str, *, special_tokens: bool = True) -> list:
    """The token ids of ``text`` as :func:`generate` feeds them (``special_tokens=False`` for a text a chat
    template wrote, which holds its special tokens already)."""
    enc = model.hf_tokenizer(text, add_special_tokens=special_tokens)
    return [int(i) for i in enc["input_ids"]]


def room(model, ids) -> int:
    """How many tokens the model's context leaves after ``ids``."""
    return int(model.config.context_length) - len(ids)


def _eos(model):
    gc = getattr(model.model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None)
    if eos is None:
        eos = model.hf_tokenizer.eos_token_id
    return eos


def generate(model, prompt: str, *, max_new_tokens: int = 32, temperature: float = 0.0, seed: int | None = None,
             special_tokens: bool = True) -> Generation:
    """Continue ``prompt`` (what the model reads: a chat template already applied) with transformers'
    ``model.generate`` (its attention on qkv): greedy when ``temperature`` is 0, else sampling from
    softmax(logits / temperature) over the whole vocabulary (no top-k, no top-p), seeded by ``seed`` (torch's
    generator, restored after). Stops at ``max_new_tokens`` or at the end-of-sequence token. ``model``: a
    :class:`qkv.hf.Model` of a causal language model; ``special_tokens``: whether the tokenizer adds its special
    tokens (a BOS) to ``prompt`` (False for a chat template's text, which holds them).

    Raises:
        ValueError naming ``model`` (an encoder), ``prompt`` (empty, or no room left in the context) or
        ``max_new_tokens`` (more than the context leaves).
    """
    import torch
    from transformers import GenerationConfig

    check_decoder(model)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"prompt: expected a non-empty text, got {prompt!r}")
    ids = prompt_ids(model, prompt, special_tokens=special_tokens)
    left, n = room(model, ids), model.config.context_length
    if not ids or left < 1:
        raise ValueError(f"prompt: {len(ids)} tokens, the model's context holds {n}: no room for a new token")
    if not 1 <= max_new_tokens <= left:
        raise ValueError(f"max_new_tokens: expected 1 … {left} (the context holds {n} tokens, the prompt takes "
                         f"{len(ids)}), got {max_new_tokens}")
    eos = _eos(model)
    pad = model.hf_tokenizer.pad_token_id
    sample = temperature > 0
    cfg = GenerationConfig(max_new_tokens=int(max_new_tokens), do_sample=sample,
                           temperature=float(temperature) if sample else None, top_k=0 if sample else None,
                           top_p=1.0 if sample else None, eos_token_id=eos,
                           pad_token_id=pad if pad is not None else eos)
    x = torch.tensor([ids], dtype=torch.long)                              # (1, P)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        if seed is not None:
            torch.manual_seed(int(seed))
        out = model.model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=cfg)
    new = [int(i) for i in out[0, len(ids):]]
    stops = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    finish = "eos" if new and new[-1] in stops else "length"
    shown = model.hf_tokenizer.decode(new, skip_special_tokens=True)
    return Generation(prompt=prompt, prompt_ids=ids, ids=new, text=shown, finish_reason=finish)


def sequence_attentions(model, ids):
    """Per layer, the attention weights (H, T, T) float32 of ``model`` (a :class:`qkv.hf.Model`) over one
    sequence of token ids, computed by qkv (:func:`qkv.hf.record` around one forward pass, causal for a decoder):
    on ids rather than a text, since a continuation is not always its text's tokenization."""
    import torch

    from qkv.integrations.hf._record import record

    x = torch.tensor([list(ids)], dtype=torch.long)                        # (1, T)
    with record(model.model) as rec, torch.no_grad():
        model.model(input_ids=x, attention_mask=torch.ones_like(x))
    for layer in rec.layers:
        yield np.asarray(rec.weights[layer][0], dtype=np.float32)          # (H, T, T)
