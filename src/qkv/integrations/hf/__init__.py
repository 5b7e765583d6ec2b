"""qkv in transformers: every attention layer of a Hugging Face model on qkv, and any model's heads explained.

    import qkv.hf
    qkv.hf.register()                                       # "qkv" in transformers' attention registries
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="qkv")
    model.set_attn_implementation("qkv")                    # or switch a loaded model

    with qkv.hf.record(model, layers=[2], heads=[0, 3], rows=[-1]) as rec:
        model(**inputs)
    rec.weights[2]        # (B, 2, 1, S): heads 0 and 3, the last query's attention weights
    rec.traces[2]         # a qkv.Trace of head 0: Q, K (after RoPE), scores, scaled, masked, weights, output

:func:`register` adds ``"qkv"`` to ``transformers.AttentionInterface`` (the attention function,
:func:`qkv.hf._attention.attention`) and to ``transformers.masking_utils.AttentionMaskInterface`` (the mask
function, :func:`qkv.hf._mask.mask_function`: the model's mask as qkv's block structure — causal, sliding windows,
padding — never a dense (B, 1, L, S) tensor). Forward and backward: with gradients the layers run on
``qkv.torch`` (autograd through qkv's own backward), without on qkv's NumPy functions. :func:`record` keeps what
chosen layers, heads and query rows computed; :func:`compare` ranks the heads of two checkpoints by how far their
rows moved. :func:`load` reads a local model folder for ``qkv model --hf`` and
``qkv view --hf``. Needs torch and transformers (the ``dev`` extra installs both); ``import qkv`` does not import
them. Mask convention: True = may attend.
"""
from __future__ import annotations

from qkv.integrations.hf._compare import Comparison, HeadShift, compare
from qkv.integrations.hf._folder import check_folder
from qkv.integrations.hf._record import Recording, record
from qkv.integrations.hf._register import NAME, register
from qkv.integrations.hf._summary import LayerSummary, Summaries

__all__ = ["NAME", "Comparison", "HeadShift", "LayerSummary", "Model", "Recording", "Summaries", "check_folder", "compare", "load",
           "record", "register"]


def load(path, **kwargs):
    """A local transformers model folder (config.json + safetensors; nothing is downloaded) on qkv, with its
    tokenizer, as :class:`qkv.hf.Model`: ``run``, ``tokenize``, ``trace_layer``, ``config`` — what ``qkv model``
    and ``qkv view`` read. See :func:`qkv.hf._model.load`."""
    from qkv.integrations.hf._model import load as _load
    return _load(path, **kwargs)


def __getattr__(name):
    if name == "Model":                                   # the class load returns (imports nothing heavy itself)
        from qkv.integrations.hf._model import Model
        return Model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
