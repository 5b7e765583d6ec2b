"""What the model families share: the validation of their text, index and path arguments (clear errors naming
the argument, expected vs actual), the model file in an installed distribution, the padding of a batch of
token ids, the per-layer record ``run`` keeps, and the outputs' notebook view."""
from __future__ import annotations

import importlib.metadata
import numbers
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from qkv import _display
from qkv.core.tracing import Trace


def texts_arg(texts, name: str = "texts") -> tuple[list[str], bool]:
    """Validate texts: a str (→ one text) or a sequence of non-empty str. Returns (list, was_single)."""
    if isinstance(texts, str):
        items, single = [texts], True
    elif isinstance(texts, (bytes, bytearray, dict)) or not isinstance(texts, Iterable):
        raise TypeError(f"{name}: expected a string or a list of strings, got {type(texts).__name__}")
    else:
        items, single = list(texts), False
    if not items:
        raise ValueError(f"{name}: expected at least one text, got an empty {type(texts).__name__}")
    for i, t in enumerate(items):
        where = name if single else f"{name}[{i}]"
        if not isinstance(t, str):
            raise TypeError(f"{where}: expected a str, got {type(t).__name__} {t!r:.60}")
        if not t.strip():
            raise ValueError(f"{where}: expected a non-empty text, got {t!r} (nothing to tokenize)")
        check_utf8(t, where)
    return items, single


def check_utf8(text: str, where: str) -> None:
    """A ValueError when ``text`` holds what UTF-8 cannot encode: lone surrogates, which is how Python passes on
    bytes that were not UTF-8 (a command-line argument or file in another encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"{bad!r}"
        raise ValueError(f"{where}: not UTF-8 text ({byte} at character {e.start}); expected text in UTF-8 (was "
                         "it written in another encoding?)") from None


def index_arg(value, name: str, count: int, what: str) -> int:
    """Validate an index into ``count`` ``what`` (layers, heads): an int in 0 … count−1."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an integer in 0..{count - 1}, got {type(value).__name__} {value!r}")
    if not 0 <= int(value) < count:
        raise ValueError(f"{name}: expected an integer in 0..{count - 1} (the model has {count} {what}), "
                         f"got {value}")
    return int(value)


def text_and_layer(text, layer, num_layers: int) -> tuple[list[str], int]:
    """``trace_layer``'s arguments checked: one non-empty str (as a one-item list) and a layer index."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    items, _ = texts_arg(text, "text")
    return items, index_arg(layer, "layer", num_layers, "layers")


def path_arg(path, default: Callable[[], Path], expected: str) -> Path:
    """A loader's ``path`` argument: None → ``default()``; a str or Path (``~`` expanded); else a TypeError
    saying ``expected`` (e.g. "a folder path")."""
    if path is None:
        return default()
    if isinstance(path, (str, Path)):
        return Path(path).expanduser()
    raise TypeError(f"path: expected {expected} (str or pathlib.Path) or None, got {type(path).__name__}")


def installed_file(distribution: str, match: Callable, not_installed: str, no_file: str) -> Path:
    """The first file of the installed ``distribution`` for which ``match(file)`` holds (found, not imported),
    resolved; an ImportError saying ``not_installed`` or ``no_file`` otherwise."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(not_installed) from None
    for f in dist.files or ():
        if match(f):
            return Path(dist.locate_file(f)).resolve()
    raise ImportError(no_file)


def pad_ids(seqs: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token id lists padded on the right to the longest: ids (B, T) int64 and the mask (B, T) bool, True at
    real tokens."""
    lengths = [len(s) for s in seqs]
    T = max(lengths)
    ids = np.full((len(seqs), T), pad_id, dtype=np.int64)
    for b, s in enumerate(seqs):
        ids[b, :lengths[b]] = s
    mask = np.arange(T)[None, :] < np.asarray(lengths)[:, None]        # (B, T)
    return ids, mask


def record_layers(x: np.ndarray, layers, step, q: str, k: str) -> tuple[list, list, list, list, list]:
    """Run ``x = step(x, layer, trace)`` through ``layers`` and keep, as ``run`` returns them, the hidden
    states (the input, then every layer's output) and per layer the weights, Q (the trace's stage ``q``),
    K (stage ``k``) and V — the arrays the layer's own attention recorded, not a recomputation."""
    hidden, attns, qs, ks, vs = [x], [], [], [], []
    for layer in layers:
        t = Trace()
        x = step(x, layer, t)
        attns.append(t["weights"].array)                                   # (B, H, T, T)
        qs.append(t[q].array)                                              # (B, H, T, E)
        ks.append(t[k].array)                                              # (B, Hk, T, E)
        vs.append(t["V_heads"].array)                                      # (B, Hk, T, E)
        hidden.append(x)
    return hidden, attns, qs, ks, vs


class NotebookView:
    """An output's ``_repr_html_``: in a notebook, every layer and head of the first text, as the offline page
    (:func:`qkv.viz.show`)."""

    def _repr_html_(self) -> str:
        return _display.html(self)

    def _shapes(self) -> str:
        """The part of ``__repr__`` both outputs share: batch, padded length, the texts' lengths."""
        B, T = self.input_ids.shape
        return f"batch={B}, tokens={T} (padded), lengths={[len(t) for t in self.tokens]}"

    def _heads(self) -> str:
        H = self.attentions[0].shape[1] if self.attentions else 0
        return f"{len(self.attentions)} layers × {H} heads of attentions/queries/keys/values"
