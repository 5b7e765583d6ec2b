"""The page's views of a transformers model folder (:func:`qkv.hf.load`): its generation view and the comparison
of two checkpoints.

    data = {"generation": hf_generation_data(model, "the cat", max_new_tokens=8), "first": "generation"}
    data = {"compare": compare_data(base, tuned, "the cat sat"), "first": "compare"}
    write_page("p.html", data)

:func:`hf_generation_data` has the shape of :func:`qkv.viz.generation_data` (the SmolLM2 view): transformers'
``generate`` writes the continuation (attention on qkv), one forward pass recorded by :func:`qkv.hf.record`
gives every generated token's row (see :mod:`qkv.hf.generation_rows` for why that row is the step's own).
``chat=True`` renders the tokenizer's own ``chat_template`` with qkv's sandboxed renderer
(:mod:`qkv.models.chat`: jinja2's immutable sandbox with limits on time, memory and output), never with
transformers' ``apply_chat_template``. :func:`compare_data` draws :func:`qkv.hf.compare`: both models' weights of
every head side by side and the heads ranked by the Jensen–Shannon divergence of their rows.
"""
from __future__ import annotations

import numpy as np

from qkv.viz.page import MAX_PAGE_BYTES, MapSet, _check_cells, _model_name, steps_view


def chat_prompt(model, prompt: str) -> str:
    """``prompt`` as a user message in the tokenizer's chat template (the folder's ``chat_template``), the
    assistant's turn opened, rendered in qkv's sandbox (:mod:`qkv.models.chat`). ValueError naming ``chat``
    when the folder has no template; the template's own failures are one ValueError naming the folder."""
    from qkv.models import chat as _chat

    tok, name = model.hf_tokenizer, model.config.name
    source = getattr(tok, "chat_template", None)
    if isinstance(source, dict):                            # several named templates: the default one
        source = source.get("default")
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"chat: {name} has no chat template (tokenizer_config.json's chat_template or "
                         f"chat_template.jinja)")
    template = _chat.compile_template(source, name)
    special = {k: v for k, v in (("bos_token", tok.bos_token), ("eos_token", tok.eos_token)) if v is not None}
    return _chat.render(template, name, messages=[{"role": "user", "content": prompt}], add_generation_prompt=True,
                        **special)                                  # (a token the tokenizer lacks stays undefined)


def _shown(model, ids) -> list[str]:
    """Each id as the page shows it: decoded by itself (special tokens kept)."""
    return [str(model.hf_tokenizer.decode([int(i)])) for i in ids]


def hf_generation_data(model, prompt: str, *, max_new_tokens: int = 32, chat: bool = False,
                       temperature: float = 0.0, seed: int | None = None) -> dict:
    """The page's ``"generation"`` value for a causal transformers model (a :class:`qkv.hf.Model`): generate
    (greedy when ``temperature`` is 0, else sampling seeded by ``seed``), then every generated token's attention
    row in every layer and head, from one forward pass over prompt + continuation (with a causal mask each row is
    the one that token's own step computed; the row of generated token s is the query at position P + s).
    Returns :func:`qkv.viz.generation_data`'s shape, with the sequence's model view under ``"model"``.

    Raises:
        ValueError naming ``model`` (an encoder), ``prompt``, ``max_new_tokens`` (1 … the room the context
        leaves), ``temperature``, ``seed`` or ``chat`` (no template; a template that fails);
        PageTooLarge over the page's limits.
    """
    from qkv.integrations.hf import generation_rows as gen
    from qkv.models import check_sampling

    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"prompt: expected a non-empty text, got {prompt!r}")
    max_new_tokens, temperature, _, _, seed = check_sampling(max_new_tokens, temperature, None, None, seed, chat)
    gen.check_decoder(model)
    text = chat_prompt(model, prompt) if chat else prompt
    g = gen.generate(model, text, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                     special_tokens=not chat)
    return steps_view(model, g, prompt, chat, lambda ids: gen.sequence_attentions(model, ids),
                      lambda ids: _shown(model, ids), kv_heads=int(model.config.num_kv_heads), source="qkv.hf")


def _count(choice, n: int) -> int:
    """How many of ``n`` layers or heads ``choice`` (None: all, an int, or a sequence) picks."""
    if choice is None:
        return n
    return 1 if isinstance(choice, (int, np.integer)) else len(choice)


def compare_data(a, b, text: str, *, layers=None, heads=None) -> dict:
    """The page's ``"compare"`` value: :func:`qkv.hf.compare` of two :class:`qkv.hf.Model` on ``text`` (one
    sequence, tokenized by ``a``'s tokenizer): every compared head's weights in both models (maps ``k`` and
    ``n + k`` for pair ``k`` of ``pairs``) and the table, ranked, as ``[layer, head, js_mean, js_max]`` (bits).

    Raises:
        ValueError naming ``b`` (another architecture) or ``text``; PageTooLarge over the page's limits.
    """
    from qkv.integrations.hf import compare

    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"text: expected a non-empty sentence, got {text!r}")
    ids, _ = a._ids([text])                                                     # (1, T), the context's limit
    T, causal = ids.shape[1], bool(a.config.decoder)
    what = f"two models' attention over {T:,} tokens"
    maps_per_model = _count(layers, a.config.num_layers) * _count(heads, a.config.num_heads)
    _check_cells(2 * maps_per_model, T, T, causal, what)                       # before both forward passes
    result = compare(a, b, text, layers=layers, heads=heads)
    pairs = [[int(layer), int(h)] for layer, hs in result.heads_of.items() for h in hs]
    maps = MapSet(thumbs=False, budget=MAX_PAGE_BYTES - 1_000_000, what=what)
    for side in (result.weights_a, result.weights_b):
        for layer, w in side.items():
            maps.add_group(list(np.asarray(w[0])), causal=causal, label=f"layer {layer}")   # (heads, T, T)
    return {"kind": "compare", "name": _model_name(a), "name_b": _model_name(b), "text": text,
            "tokens": a._shown(ids[0]), "T": int(T), "causal": causal,
            "pairs": pairs, "maps": maps.to_json(), "unit": result.unit,
            "table": [[r.layer, r.head, r.js_mean, r.js_max] for r in result.rows]}
