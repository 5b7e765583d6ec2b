"""Beyond one machine: ring attention over ``torch.distributed``, exact, forward and backward, and explained.

- :func:`shard` / :func:`unshard` — a rank's share of a sequence in the ``"zigzag"`` (balanced causal work)
  or ``"contiguous"`` layout, and back (NumPy only).
- :func:`ring_attention` / :func:`ring_attention_backward` — called on every rank with its shards; K/V blocks
  (and in the backward their gradients) pass around the ring with ``isend``/``irecv`` overlapping the tiled
  engine's compute; partial results merge by log-sum-exp (:func:`qkv.merge.merge_partials`); equal to the
  single-process :func:`qkv.scaled_dot_product_attention` and its backward.
- :func:`launch` — start P local processes (``torch.multiprocessing``, gloo on 127.0.0.1) and run a function
  on each; ``qkv ring`` is built on it.
- :func:`trace_ring` — the ring simulated in one process, step by step, for ``qkv explain --ring P``.

torch is imported only when a ring runs: ``import qkv.distributed`` does not import it.
"""
from ._layout import LAYOUTS, shard, unshard
from ._ring import DEFAULT_TIMEOUT, RingError, ring_attention, ring_attention_backward

__all__ = ["DEFAULT_TIMEOUT", "LAYOUTS", "RingError", "launch", "ring_attention", "ring_attention_backward",
           "shard", "trace_ring", "unshard"]


def __getattr__(name):
    if name == "launch":
        from ._launch import launch
        return launch
    if name == "trace_ring":
        from ._trace import trace_ring
        return trace_ring
    raise AttributeError(f"module 'qkv.distributed' has no attribute {name!r}")
