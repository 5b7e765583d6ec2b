"""``qkv.hf.record``: what chosen layers, heads and query rows of a transformers model computed, kept on qkv.

    with qkv.hf.record(model, layers=None, heads=None, rows=None) as rec:
        model(**inputs)

Inside the ``with`` block every attention layer runs on qkv (the model is switched to
``attn_implementation="qkv"`` for the block and back after it); each chosen layer hands its queries and keys
(after the positions), values and mask to the recording, which keeps

- ``rec.weights[layer]``: (B, heads, rows, S) float32, the attention weights of the chosen heads and query rows,
  computed by qkv's stages for those rows only (rows × S per head, never L × S when rows are chosen);
- ``rec.traces[layer]``: a :class:`qkv.Trace` of the first chosen head (all batch rows, the chosen query rows):
  ``Q``, ``K`` (after RoPE), ``V``, ``scores``, ``scaled`` (``capped`` with soft-capping), ``masked``,
  ``weights``, ``output`` — the pipeline run on them (:func:`qkv.pipeline.attend`), so the explainer, the
  checker and the pictures render the real computation; its row r is query ``rows[r]``.

A layer is its attention module's ``layer_idx`` (0-based), as transformers numbers them. Where those repeat — an
encoder–decoder's encoder layer 0, decoder layer 0 and its cross-attention — the layers are the attention
modules' names in the model instead (``"model.decoder.layers.0.encoder_attn"``). Mask convention: True = may
attend.

A layer called several times in the block — ``model.generate(...)``: once for the prompt, then once per new
token — keeps its **first** call (the prompt) in ``weights`` and ``traces``, and the last query row of **every**
call in ``rec.generation[layer]`` (B, heads, new_tokens, S_total): row t is the attention of the query that produced
new token t (see :mod:`qkv.hf._generation`); ``rec.tokens`` (B, new_tokens) are the ids ``generate`` added. qkv's
own decoder (:class:`qkv.models.llama.LlamaModel`) records through the same class: ``record(llama_model)``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np

from qkv.integrations.hf import _generation
from qkv.integrations.hf._register import register
from qkv.integrations.hf._summary import check_weights, options, summarize
from qkv.integrations.hf._state import ACTIVE
from qkv.integrations.hf._state import numpy as _numpy


class Recording:
    """What :func:`record` kept (see the module).

    Attributes:
        weights: ``{layer: (B, len(heads), len(rows), S) float32}`` attention weights of the chosen heads and rows
            (``layer`` an index, or a module's name: see the module).
        traces: ``{layer: qkv.Trace}`` of the first chosen head (``trace_head``).
        layers: the recorded layers, in order (those the model ran among the chosen).
        heads: the chosen heads as given (None: all; each layer's resolved in ``heads_of[layer]``).
        rows: the chosen query rows as given (None: all; negative counts from the end).
        trace_head: the head the traces follow, as given (the first chosen, 0 by default).
        rows_of: ``{layer: (R,) int}`` the query rows each layer's weights and trace hold (negatives resolved).
        heads_of: ``{layer: (h,) int}`` the heads each layer's weights hold.
        generation: ``{layer: (B, h, N, S_total) float32}`` the last query row of each of the layer's N calls
            (``generate``: row t made new token t; one forward: N = 1); keys beyond a call's S are 0.
        tokens: ``(B, N) int64`` the ids ``generate`` added in the block, or None (no ``generate``).
        key_offsets: ``{layer: (N,) int64}`` the token position of each generation row's key 0 (0 unless the
            layer's cache keeps only a sliding window); ``generation_by_position`` the rows placed there.
        attentions: the weights as transformers' ``outputs.attentions``: a tuple over the recorded layers of
            (B, h, rows, S).
        summaries: ``{layer: qkv.hf.LayerSummary}`` with ``summaries=``: every chosen head's entropy,
            mean distance, sink share, kind and max-pooled map, streamed over blocks of query rows (no L × S
            weights; without ``rows`` nothing else is kept).
    """

    def __init__(self, layers=None, heads=None, rows=None, *, model=None, trace_all: bool = False,
                 summaries=None):
        self._layers = _layer_choice(layers)
        self._keys = {} if model is None else layer_keys(model)
        self.heads = _ints(heads, "heads")
        self.rows = _ints(rows, "rows")
        self.trace_head = 0 if not self.heads else self.heads[0]
        self.weights: dict = {}
        self.traces: dict = {}
        self.rows_of: dict = {}
        self.heads_of: dict = {}
        self._order: dict[int, int] = {}
        self._steps: dict = {}                  # {layer: [(B, h, S) per call]}: each call's last query row
        self._first: dict = {}                  # {layer: (L, S) of its first call}
        self._stacked: tuple = (None, {})       # (calls counted, generation built from them)
        self.tokens: np.ndarray | None = None
        self._trace_all = bool(trace_all)       # True: the traces hold every chosen head (Model.trace_layer)
        self.summaries: dict = {}
        self._summary = options(summaries)       # None, or how to summarise (qkv.hf._summary.Summaries)

    @property
    def layers(self) -> list:
        """The recorded layers: indices in order, or module names in the order the model ran them."""
        keys = list(self._steps)
        return sorted(keys) if all(isinstance(k, int) for k in keys) else keys

    @property
    def attentions(self) -> tuple:
        """The weights of the recorded layers in order, as transformers' ``outputs.attentions``: a tuple of
        (B, h, rows, S) float32 — what :func:`qkv.viz.head_kinds` and :func:`qkv.viz.rollout` take (they read
        batch row 0; ``record(model)`` for every head and row)."""
        return tuple(self.weights[i] for i in self.layers if i in self.weights)

    @property
    def generation(self) -> dict:
        """``{layer: (B, h, N, S_total) float32}``: row t the last query row of the layer's call t, over that
        call's keys as transformers counts them (``out.attentions[t][layer][:, :, -1]``), 0 beyond them (see the
        module); built from the kept rows on first use after a call."""
        calls = sum(len(r) for r in self._steps.values())
        if self._stacked[0] != calls:
            offsets = self.key_offsets
            self._stacked = (calls, {i: _generation.stack_rows(self._steps[i], offsets[i]) for i in self.layers})
        return dict(self._stacked[1])

    @property
    def generation_by_position(self) -> dict:
        """``generation`` with each row at its tokens' positions: key j of row t at column
        ``key_offsets[layer][t] + j`` (the same as ``generation`` except where a cache keeps a sliding window)."""
        offsets = self.key_offsets
        return {i: _generation.stack_rows(self._steps[i], offsets[i], by_position=True) for i in self.layers}

    @property
    def key_offsets(self) -> dict:
        """``{layer: (N,) int64}``: the token position of generation row t's key 0 — 0, unless the layer's cache
        keeps only a sliding window (then key j of row t is token ``key_offsets[layer][t] + j``)."""
        return {i: _generation.key_offsets(self._first[i], [r.shape[-1] for r in self._steps[i]])
                for i in self.layers}

    def __repr__(self) -> str:
        inner = ", ".join(f"{i}: {self.weights[i].shape}" for i in self.layers if i in self.weights)
        calls = f", {max(len(r) for r in self._steps.values())} calls" if self._steps else ""
        return f"Recording({{{inner}}}{calls}, trace_head={self.trace_head})"

    def _layer_key(self, module):
        key = self._keys.get(id(module))
        if key is None:
            key = getattr(module, "layer_idx", None)
        if key is None:                                           # no layer_idx: the order of first calls
            key = self._order.setdefault(id(module), len(self._order))
        return key if isinstance(key, str) else int(key)

    def observe(self, module, spec, query, key, value) -> None:
        """Called by the attention function with one layer's call (see the module)."""
        layer = self._layer_key(module)
        if self._layers is not None and layer not in self._layers:
            return
        self.observe_arrays(layer, spec, _numpy(query), _numpy(key), _numpy(value))

    def observe_arrays(self, layer, spec, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """One call of ``layer``: q (B, Hq, L, E), k (B, Hk, S, E), v (B, Hk, S, Ev) as NumPy, after the
        positions, and its :class:`~qkv.hf._attention.Spec`. Keeps the call's last query row (B, h, S) for
        ``generation``; the layer's first call also in ``weights`` and ``traces``."""
        if self._layers is not None and layer not in self._layers:
            return
        heads = _resolve(self.heads, q.shape[1], "heads", f"the layer has {q.shape[1]} heads")
        if layer not in self._steps:
            self._first_call(layer, spec, q, k, v, heads)
            self._first[layer] = (q.shape[2], k.shape[2])
        last = spec.weights(q, k, heads, [q.shape[2] - 1])[:, :, 0]          # (B, h, S): made the next token
        self._steps.setdefault(layer, []).append(last.astype(np.float32, copy=False))

    def _first_call(self, layer, spec, q: np.ndarray, k: np.ndarray, v: np.ndarray, heads: np.ndarray) -> None:
        """The weights, trace (and summaries) of the layer's first call (see the module)."""
        L = q.shape[2]
        rows = _resolve(self.rows, L, "rows", f"the call has {L} query rows")
        if self._summary is not None:                                       # streamed: never L × S at once
            self.summaries[layer] = summarize(spec, q, k, heads, self._summary)
            if self.rows is None:
                return
        elif self.rows is None:                                             # every row: the limit first
            check_weights(layer, q.shape[0], len(heads), L, k.shape[2])
        self.weights[layer] = spec.weights(q, k, heads, rows).astype(np.float32, copy=False)
        self.traces[layer] = _trace(spec, q, k, v, heads if self._trace_all else heads[:1], rows)
        self.rows_of[layer], self.heads_of[layer] = rows, heads


def layer_keys(model) -> dict:
    """``id(attention module) → layer``: its ``layer_idx`` when the model's attention modules have distinct ones,
    else its name in the model (see the module)."""
    found = [(n, m) for n, m in model.named_modules()
             if "Attention" in type(m).__name__ and getattr(m, "layer_idx", None) is not None]
    idx = [int(m.layer_idx) for _, m in found]
    if len(set(idx)) == len(idx):
        return {id(m): i for (_, m), i in zip(found, idx)}
    return {id(m): n for n, m in found}


def _layer_choice(layers):
    """None, or a list of layer indices and/or module names; TypeError naming ``layers`` otherwise."""
    if isinstance(layers, str):
        return [layers]
    if layers is not None and not isinstance(layers, (int, np.integer)):
        try:
            items = list(layers)
        except TypeError:
            items = None
        if items and all(isinstance(i, str) for i in items):
            return items
    return _ints(layers, "layers")


def _ints(x, name: str):
    """None, or a list of ints from an int or a sequence of ints; TypeError naming ``name`` otherwise."""
    if x is None:
        return None
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return [int(x)]
    try:
        out = [int(i) for i in x if isinstance(i, (int, np.integer)) and not isinstance(i, bool)]
    except TypeError:
        out = None
    if out is None or len(out) != len(list(x)) or not out:
        raise TypeError(f"{name}: expected None, an int or a non-empty sequence of ints, got {x!r:.80}")
    return out


def _resolve(chosen, n: int, name: str, what: str) -> np.ndarray:
    """The chosen indices in 0 … n−1 (negatives from the end); ValueError naming ``name`` when out of range."""
    if chosen is None:
        return np.arange(n)
    bad = [i for i in chosen if not -n <= i < n]
    if bad:
        raise ValueError(f"{name}: expected indices in {-n} … {n - 1} ({what}), got {bad}")
    return np.asarray([i % n for i in chosen], dtype=np.int64)


def _trace(spec, q, k, v, heads: np.ndarray, rows: np.ndarray):
    """The chosen heads' attention through qkv's pipeline, recorded: a :class:`qkv.Trace` (see the module).

    The score mod is softcap (elementwise: the same on a subset of heads and rows); the mask is evaluated at the
    chosen rows; the key/value heads are those each chosen query head reads."""
    from qkv.core import pipeline, stages
    from qkv.core.tracing import trace

    heads = np.asarray(heads, dtype=np.int64)
    group = q.shape[1] // k.shape[1]
    qh = q[:, heads][:, :, rows]                                             # (B, h, R, E)
    kh, vh = k[:, heads // group], v[:, heads // group]                      # (B, h, S, E), (B, h, S, Ev)
    sinks = None if spec.sinks is None else _numpy(spec.sinks)[heads].astype(qh.dtype)   # (h,)
    mask = spec.mask_rows(rows, heads)                                       # (B or 1, 1 or h, R, S)
    with trace() as t:
        stages.observe_input("Q", qh)
        stages.observe_input("K", kh)
        stages.observe_input("V", vh)
        pipeline.attend(qh, kh, vh, scale=spec.scale, d_k=q.shape[-1], mask=mask,
                        mask_source=None if spec.mask is None else spec.mask.mask_mod, score_mod=spec.score_mod,
                        sink_logits=sinks)
    return t


@contextlib.contextmanager
def record(model, layers=None, heads=None, rows=None, *, summaries=False) -> Iterator[Recording]:
    """Keep what the chosen ``layers``, ``heads`` and query ``rows`` of ``model`` compute inside the block.

    Args:
        model: a transformers model (any attention implementation: it runs on qkv inside the block), or qkv's
            decoder (:class:`qkv.models.llama.LlamaModel`: its ``generate``, ``step`` and ``forward``).
        layers: None (all) or the layer indices (``module.layer_idx``; 0-based) to keep — or the attention
            modules' names, where an encoder–decoder repeats the indices (see the module).
        heads: None (all) or the query heads whose weights to keep; the trace follows the first (0 by default).
        rows: None (all) or the query rows (0-based within the call; −1 the last) to keep.
        summaries: True (or ``qkv.hf.Summaries(tokens=…, pool=…)``): also ``rec.summaries[layer]``,
            every chosen head summarised without its L × S weights; without ``rows`` no weights are kept.

    Yields:
        a :class:`Recording`: ``weights[layer]`` (B, heads, rows, S), ``traces[layer]``, ``layers``, ``attentions``,
        ``generation[layer]`` (B, heads, new_tokens, S_total), ``tokens`` … (see the module). A layer called
        several times (``generate``) keeps its first call in ``weights`` and ``traces``, every call's last query
        row in ``generation``.

    Raises:
        TypeError naming the argument for layers/heads/rows that are not ints; ValueError (inside the block)
        for a head or row the layer does not have, and without ``rows`` or ``summaries`` for a layer whose
        weights would pass ``qkv.hf._summary.MAX_WEIGHT_BYTES`` (1 GiB; the message offers both).
    """
    if not hasattr(model, "set_attn_implementation") and hasattr(type(model), "attention_observer"):
        rec = Recording(layers, heads, rows, summaries=summaries)               # qkv's own decoder
        with _generation.decoder_observed(model, rec), _generation.generate_wrapped(model, rec):
            yield rec
        return
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model: expected a transformers PreTrainedModel (or qkv's LlamaModel), got "
                        f"{type(model).__name__}")
    rec = Recording(layers, heads, rows, model=model, summaries=summaries)
    name = register()
    before = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if before != name:
        model.set_attn_implementation(name)
    token = ACTIVE.set(rec)
    try:
        with _generation.generate_wrapped(model, rec):
            yield rec
    finally:
        ACTIVE.reset(token)
        if before != name and before is not None:
            model.set_attn_implementation(before)
