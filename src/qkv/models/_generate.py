"""Sampling and generation for :class:`qkv.models.llama.LlamaModel`: the checks on the settings
(:func:`check_sampling`, also run by the command line before a model loads), the choice of the next token
(:func:`choose`), the incremental decoding that ``stream`` receives (:class:`Pieces`) and the result
(:class:`Generation`). No model here: :meth:`LlamaModel.generate` drives them."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass
class Generation:
    """What :meth:`LlamaModel.generate` produced.

    text            the continuation only, decoded (without the end-of-sequence token that stopped it)
    ids             the continuation's token ids, including that end-of-sequence token when it stopped there
    prompt_ids      the prompt's token ids (after the chat template, when ``chat=True``)
    prompt          the text that was tokenized (the rendered chat template, when ``chat=True``)
    finish_reason   "eos" (the model ended it) or "length" (max_new_tokens reached)
    """

    text: str
    ids: list[int]
    prompt_ids: list[int]
    prompt: str
    finish_reason: str

    def __str__(self) -> str:
        return self.text


def real(value, name: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return v


def choose(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None,
           rng: np.random.Generator | None) -> int:
    """The next token from one row of logits (V,): argmax at temperature 0, else a draw from
    softmax(logits / temperature) restricted to the top_k largest and then to the top_p nucleus."""
    if temperature == 0.0:
        return int(np.argmax(logits))                              # the first maximum, as torch.argmax
    z = logits.astype(np.float64) / temperature                    # (V,)
    if top_k is not None and top_k < z.shape[0]:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)                          # ties at the k-th value stay (as HF)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = int(np.searchsorted(cum, top_p)) + 1                # the smallest prefix reaching top_p
        drop = order[keep:]
        p[drop] = 0.0
        p /= p.sum()
    cdf = np.cumsum(p)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(i, p.shape[0] - 1)


#: The smallest temperature above 0: logits / T must stay finite in float32 (logits reach ~±40, and float32's
#: largest is 3.4e38), and below it softmax(logits / T) puts all but ~1e-30 of the weight on the largest logit.
MIN_TEMPERATURE = 1e-3


def check_sampling(max_new_tokens=64, temperature=0.0, top_k=None, top_p=None, seed=None, chat=False,
                   stream=None) -> tuple[int, float, int | None, float | None, int | None]:
    """The checks :meth:`LlamaModel.generate` makes on its settings, without a model (the command line runs
    them before loading one): ``(max_new_tokens, temperature, top_k, top_p, seed)`` or a TypeError/ValueError
    naming the argument. (Whether max_new_tokens fits the context is checked once the prompt is tokenized.)"""
    if not isinstance(chat, (bool, np.bool_)):
        raise TypeError(f"chat: expected True or False, got {type(chat).__name__} {chat!r}")
    if isinstance(max_new_tokens, (bool, np.bool_)) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(f"max_new_tokens: expected an integer, got {type(max_new_tokens).__name__} "
                        f"{max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens}")
    temperature = real(temperature, "temperature")
    if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature: expected 0 (greedy) or a number >= {MIN_TEMPERATURE:g} (below it logits / T "
                         f"overflows and the sample is the greedy choice anyway), got {temperature:g}")
    if top_k is not None:
        if isinstance(top_k, (bool, np.bool_)) or not isinstance(top_k, numbers.Integral):
            raise TypeError(f"top_k: expected an integer or None, got {type(top_k).__name__} {top_k!r}")
        if top_k < 1:
            raise ValueError(f"top_k: expected an integer >= 1, got {top_k}")
        top_k = int(top_k)
    if top_p is not None:
        top_p = real(top_p, "top_p")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p: expected a number in (0, 1], got {top_p}")
    if seed is not None:
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed: expected a non-negative integer or None, got {type(seed).__name__} {seed!r}")
        if seed < 0:
            raise ValueError(f"seed: expected a non-negative integer or None, got {seed}")
        seed = int(seed)
    if stream is not None and not callable(stream):
        raise TypeError(f"stream: expected a callable taking each new piece of text, or None, got "
                        f"{type(stream).__name__}")
    return int(max_new_tokens), temperature, top_k, top_p, seed


class Pieces:
    """Incremental decoding for ``stream``: a piece is given out only once its bytes form whole characters
    (a multi-byte character split over tokens waits for its last byte)."""

    def __init__(self, tokenizer, emit: Callable[[str], object] | None):
        self._tok, self._emit = tokenizer, emit
        self._pending: list[int] = []
        self.text = ""

    def add(self, token_id: int) -> None:
        self._pending.append(token_id)
        piece = self._tok.decode(self._pending, skip_special_tokens=False)
        if piece.endswith("\ufffd") and len(self._pending) < 4:    # an incomplete UTF-8 sequence: wait
            return
        self._pending = []
        self._out(piece)

    def flush(self) -> None:
        if self._pending:
            piece = self._tok.decode(self._pending, skip_special_tokens=False)
            self._pending = []
            self._out(piece)

    def _out(self, piece: str) -> None:
        if piece:
            self.text += piece
            if self._emit is not None:
                self._emit(piece)

