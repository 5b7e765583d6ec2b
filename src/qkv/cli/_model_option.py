"""``--model``: one meaning in every command — it names the model (``minilm`` or ``smollm2``), never the text.

``qkv model TEXT``, ``qkv heatmap --text TEXT``, ``qkv view --text TEXT`` / ``--generate PROMPT`` and
``qkv generate PROMPT`` take their text from their own argument or option; ``--model`` only chooses which model
reads it, case-insensitively. A name that is not a model (a sentence, say) or a model the command cannot use
is one line on stderr, exit 2, before anything is loaded.
"""
from __future__ import annotations

import types

import click

from qkv.locales import t

from qkv.cli import UserError

#: The models a command can name, and what each is.
MODELS = types.MappingProxyType({"minilm": "all-MiniLM-L6-v2 (encoder)", "smollm2": "SmolLM2-135M-Instruct (decoder)"})


def model_option(default: str | None, supported=tuple(MODELS), help_text: str = ""):
    """The ``--model/-m NAME`` option of a command that can use the ``supported`` models."""
    names = " or ".join(supported)
    text = help_text or f"The model: {', '.join(f'{n}, {MODELS[n]}' for n in supported)}."
    return click.option("--model", "-m", "model_name", metavar=names.replace(" or ", "|"), default=default,
                        show_default=default is not None, help=text)


def _short(value: str, n: int = 40) -> str:
    one = " ".join(str(value).split())
    return one if len(one) <= n else one[:n - 1] + "…"


def check_model(value: str, command: str, supported=tuple(MODELS), lang: str = "en",
                text_option: str | None = None) -> str:
    """``value`` as a model name (lowercase) that ``command`` supports; else a UserError of one line — for a
    value that is no model name, naming the option that takes the text (``text_option``) when there is one."""
    name = str(value).strip().lower()
    if name not in MODELS:
        hint = t("cli.model_text_hint", lang, option=text_option) if text_option else ""
        raise UserError(t("cli.model_unknown", lang, got=_short(value)) + hint)
    if name not in supported:
        raise UserError(t("cli.model_unsupported", lang, command=command, name=name,
                          names=" or ".join(supported)))
    return name
