"""``qkv.hf.register``: qkv's attention and mask functions in transformers' registries."""
from __future__ import annotations

#: The name qkv is registered under in transformers.
NAME = "qkv"


def register() -> str:
    """Register qkv as ``attn_implementation="qkv"`` in transformers; returns ``"qkv"``.

    Adds the attention function (:func:`qkv.hf._attention.attention`) to ``transformers.AttentionInterface`` and
    the mask function (:func:`qkv.hf._mask.mask_function`) to ``transformers.masking_utils.AttentionMaskInterface``
    (both global, for every model). Calling it again changes nothing. Afterwards
    ``AutoModel….from_pretrained(path, attn_implementation="qkv")`` and ``model.set_attn_implementation("qkv")``
    run every attention layer on qkv.

    Raises:
        ImportError naming what is missing when torch or transformers is not installed.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(f"qkv.hf needs torch and transformers: pip install 'qkv[dev]' ({exc})") from None
    from qkv.integrations.hf._attention import attention
    from qkv.integrations.hf._mask import mask_function

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, mask_function)
    return NAME
