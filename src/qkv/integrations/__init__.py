"""Integrations with other libraries: torch autograd and modules (``qkv.torch``), transformers'
``AttentionInterface`` and the recorder (``qkv.hf``), ring attention on ``torch.distributed``
(``qkv.distributed``). Each imports its library only when used.
"""
