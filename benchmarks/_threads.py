"""One thread count for both sides of a benchmark script: torch, qkv's runtime and BLAS (threadpoolctl)."""


def set_threads(n: int):
    """torch, qkv and BLAS on ``n`` threads; returns the threadpoolctl limiter (keep it alive) or None."""
    import torch

    import qkv
    torch.set_num_threads(n)
    qkv.set_num_threads(n)
    try:
        from threadpoolctl import threadpool_limits
        return threadpool_limits(n)
    except ImportError:                                      # pragma: no cover - the fast extra brings it
        return None
