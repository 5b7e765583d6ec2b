"""Beyond one machine: ring attention over ``torch.distributed``, exact, forward and backward, and explained.

- :func:`shard` / :func:`unshard` — a rank's share of a sequence in the ``"zigzag"`` (balanced causal work)
  or ``"contiguous"`` layout, and back (NumPy only).
- :func:`ring_attention` / :func:`ring_attention_backward` — called on every rank with its shards; K/V blocks
  (and in the backward their gradients) pass around the ring with ``isend``/``irecv`` overlapping the tiled
  engine's compute; partial results merge by log-sum-exp (:func:`qkv.merge.merge_partials`); equal to the
  single-process :func:`qkv.scaled_dot_product_attention` and its backward.
- :func:`launch` — start P local processes (``torch.multiprocessing``, gloo on 127.0.0.1) and run a function
  on each; ``qkv ring`` is built on it.
- :func:`trace_ring` — the ring simulated in one process, step by step; :func:`explain_ring` renders it for
  ``qkv explain --ring P`` (:func:`default_worked`: its default example); :func:`run_ring` is ``qkv ring``.
- :func:`length_error` — why a length cannot be split over P ranks in a layout (None when it can).

torch is imported only when a ring runs: ``import qkv.distributed`` does not import it.
"""
from qkv.integrations.distributed._layout import LAYOUTS, length_error, shard, unshard
from qkv.integrations.distributed._ring import DEFAULT_TIMEOUT, RingError, ring_attention, ring_attention_backward

__all__ = ["DEFAULT_TIMEOUT", "LAYOUTS", "RingError", "default_worked", "explain_ring", "launch", "length_error",
           "ring_attention", "ring_attention_backward", "run_ring", "shard", "trace_ring", "unshard"]


def __getattr__(name):
    if name == "launch":
        from qkv.integrations.distributed._launch import launch
        return launch
    if name == "run_ring":                                # qkv ring: launch, check, report
        from qkv.integrations.distributed._launch import run_ring
        return run_ring
    if name in ("trace_ring", "default_worked", "explain_ring"):   # qkv explain --ring P
        from qkv.integrations.distributed import _trace
        return {"trace_ring": _trace.trace_ring, "default_worked": _trace.default_worked,
                "explain_ring": _trace.explain}[name]
    raise AttributeError(f"module 'qkv.distributed' has no attribute {name!r}")
