"""The state the attention function reads while it runs: the active :class:`~qkv.hf._record.Recording`, if any,
and the tensor → NumPy view both sides use. A leaf module, so that the recording and the attention function do
not import each other."""
from __future__ import annotations

import contextvars

import numpy as np

#: The recording the attention function reports each layer's call to (set by ``qkv.hf.record``), or None.
ACTIVE: contextvars.ContextVar = contextvars.ContextVar("qkv_hf_record", default=None)


def active():
    """The recording the attention function reports to now, or None."""
    return ACTIVE.get()


def numpy(t) -> np.ndarray:
    """A tensor as NumPy (float32 for half and bfloat16; float64 and bool stay), detached, without a copy for a
    float32 tensor on the CPU."""
    import torch

    t = t.detach()
    if t.dtype not in (torch.float32, torch.float64, torch.bool):
        t = t.float()
    return t.cpu().numpy()
