"""A model folder is data, never trusted: what ``--hf DIR`` and :func:`qkv.hf.load` check before anything is built.

Before torch or transformers is imported: the folder, its ``config.json`` (at most :data:`MAX_CONFIG_BYTES`, a JSON
object) and the headers of its safetensors files (shapes only, no weights read). Every count and size the config
gives is a positive integer within :data:`MAX_COUNT` (positions: :data:`MAX_POSITIONS`), and where the weights
show it, the same as the weights: the layers (the highest ``….layers.N.`` index), the vocabulary and width (the
token embedding's shape), the query heads (the first query projection's rows), the positions (a learned position
embedding's rows). A config of 10⁹ layers over a two-layer checkpoint, or of −5 positions, is refused naming the
field — before it could build a model past the machine's memory or run for minutes.
"""
from __future__ import annotations

import json
import os
import re
import struct

#: The largest config.json read (a real one is a few KB).
MAX_CONFIG_BYTES = 1 << 20
#: The largest safetensors header read (the JSON before the weights: about 100 bytes a tensor).
MAX_HEADER_BYTES = 100 << 20
#: The largest count or size a config may give (vocabularies reach ~260k, widths ~16k, layers ~200).
MAX_COUNT = 1 << 24
#: The largest ``max_position_embeddings`` (some configs say 10⁷ for RoPE models).
MAX_POSITIONS = 1 << 27

#: The counts and sizes of the config families qkv meets (Llama, BERT, GPT-2 and their kin).
COUNTS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size",
          "vocab_size", "head_dim", "max_position_embeddings", "n_layer", "n_head", "n_embd", "n_positions",
          "n_inner", "num_layers", "num_heads", "type_vocab_size")
_LAYER = re.compile(r"\.(?:layers|layer|h|blocks)\.(\d+)\.")
_EMBED = ("embed_tokens.weight", "word_embeddings.weight", "wte.weight")
_QUERY = ("q_proj.weight", "attention.self.query.weight", "attn.q_proj.weight")


def check_folder(path) -> str:
    """The folder as a str; ValueError naming ``path`` when it is no local transformers model folder qkv can
    trust (see the module)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"path: no folder {path!r}" if not os.path.exists(path) else
                         f"path: {path!r} is a file, expected a model folder (config.json + safetensors)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"path: {path!r} is not a transformers model folder (it has no config.json)")
    weights = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not weights:
        pickled = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl"))]
        extra = f" ({', '.join(pickled[:3])} is pickled: qkv never loads pickles)" if pickled else ""
        raise ValueError(f"path: {path!r} has no .safetensors weights (qkv reads safetensors only; nothing is "
                         f"downloaded){extra}")
    config = _config(path)
    _match(config, _shapes(path, weights), path)
    return path


def _config(path: str) -> dict:
    """config.json as a dict, its counts checked."""
    file = os.path.join(path, "config.json")
    size = os.path.getsize(file)
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"path: {path!r}: its config.json is {size:,} bytes, more than the {MAX_CONFIG_BYTES:,} a "
                         "model's config takes")
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"path: {path!r}: its config.json is not a valid JSON file ({_short(exc)})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"path: {path!r}: its config.json holds a {type(raw).__name__}, expected an object")
    for key in COUNTS:
        v = raw.get(key)
        if v is None:
            continue
        top = MAX_POSITIONS if key in ("max_position_embeddings", "n_positions") else MAX_COUNT
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
            raise ValueError(f"path: {path!r}: config.json: {key}: expected a positive integer of at most {top:,}, "
                             f"got {_short(v)}")
    return raw


def _shapes(path: str, files: list) -> dict:
    """Every tensor's shape, from the safetensors files' headers (no weights read)."""
    shapes: dict = {}
    for name in files:
        file = os.path.join(path, name)
        try:
            with open(file, "rb") as f:
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 2 <= n <= min(MAX_HEADER_BYTES, os.path.getsize(file) - 8):
                    raise ValueError("its header is not a safetensors header")
                header = json.loads(f.read(n).decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("its header is not a JSON object")
            for tensor, info in header.items():
                if tensor != "__metadata__":
                    shape = info.get("shape") if isinstance(info, dict) else None
                    if not isinstance(shape, list) or not all(isinstance(x, int) and x >= 0 for x in shape):
                        raise ValueError(f"tensor {tensor!r} has no valid shape")
                    shapes[tensor] = tuple(shape)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(f"path: {path!r}: its weights cannot be read ({name}: {_short(exc)})") from None
    return shapes


def _match(config: dict, shapes: dict, path: str) -> None:
    """The config's counts against what the weights hold: layers, vocabulary and width, query heads, positions."""
    def first(key_names):
        return next((v for k in key_names if (v := config.get(k)) is not None), None)

    def refuse(key, said, held):
        raise ValueError(f"path: {path!r}: config.json: {key} is {said:,}, but the weights hold {held:,}")

    layers = [int(m.group(1)) for t in shapes if (m := _LAYER.search(t))]
    key = next((k for k in ("num_hidden_layers", "n_layer", "num_layers") if k in config), None)
    if layers and key is not None and config[key] != max(layers) + 1:
        refuse(key, config[key], max(layers) + 1)
    embed = next((s for t, s in shapes.items() if t.endswith(_EMBED) and len(s) == 2), None)
    width = first(("hidden_size", "n_embd"))
    if embed is not None:
        if config.get("vocab_size") is not None and config["vocab_size"] != embed[0]:
            refuse("vocab_size", config["vocab_size"], embed[0])
        if width is not None and width != embed[1]:
            refuse("hidden_size" if "hidden_size" in config else "n_embd", width, embed[1])
    heads = first(("num_attention_heads", "n_head", "num_heads"))
    if heads is not None and width is not None:
        head_dim = config.get("head_dim") or (width // heads if width % heads == 0 else None)
        if head_dim is None:
            raise ValueError(f"path: {path!r}: config.json: hidden_size ({width:,}) is not a multiple of "
                             f"num_attention_heads ({heads:,}), and no head_dim says the heads' width")
        query = next((s for t, s in sorted(shapes.items()) if t.endswith(_QUERY) and len(s) == 2), None)
        if query is not None and heads * head_dim != query[0]:
            raise ValueError(f"path: {path!r}: config.json: num_attention_heads × head_dim is {heads:,} × "
                             f"{head_dim:,}, but the weights' query projection has {query[0]:,} rows")
    positions = next((s for t, s in shapes.items() if t.endswith("position_embeddings.weight") and len(s) == 2), None)
    if positions is not None and config.get("max_position_embeddings") not in (None, positions[0]):
        refuse("max_position_embeddings", config["max_position_embeddings"], positions[0])


def _short(x) -> str:
    text = " ".join(str(x).split()) if isinstance(x, BaseException) else repr(x)
    return text if len(text) <= 80 else text[:77] + "…"
