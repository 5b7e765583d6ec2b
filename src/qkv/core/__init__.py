"""The core: the stages the seeds teach, one function each (``stages``), their one orchestration
(``pipeline``), masks, mask and score mods, positions (sinusoidal, RoPE), shapes, the KV cache, block masks,
the merge of partial results and the Trace recorder. Public as ``qkv.stages``, ``qkv.masks``, ``qkv.mods``,
``qkv.positions``, … (:mod:`qkv._public`).
"""
