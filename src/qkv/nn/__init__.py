"""The layer-level module: :class:`qkv.MultiHeadAttention` (W_Q, W_K, W_V, heads, W_O) over the engine."""
