"""The shared part of the experiments: a tiny attention classifier trained in NumPy, Adam, seeds, plots.

The model the ``heads`` and ``train`` experiments train (shape legend: B sentences, T tokens, D model width,
H heads of width E (queries/keys) and Ev (values), C classes)::

    x = Emb[ids] + Pos[0 … T−1]                      (B, T, D)   token embeddings + learned positions
    q = x[query position] · W_Q → (B, H, 1, E)       one query per sentence (the pronoun, the last token)
    k = x · W_K → (B, H, T, E),  v = x · W_V → (B, H, T, Ev)
    o = qkv attention(q, k, v), padding keys masked  (B, H, 1, Ev)  ← qkv's forward and backward
    logits = concat(o) · W_out + b                   (B, C)
    loss = mean cross-entropy(logits, target)

The attention's forward is :func:`qkv.scaled_dot_product_attention` (with ``return_weights``: the pictures
need them), its gradients :func:`qkv.flex_attention_backward` (the reference backend: the tiled engine's
blocks cost more than they save on 1 × T scores); the chain rule of the rest — the embeddings, the
projections, the linear readout, the cross-entropy — is written out in :meth:`TinyAttention.loss_and_grads`
and checked against finite differences in ``tests/unit/test_lab.py``.
"""
from __future__ import annotations

import math

import numpy as np

import qkv
from qkv.core import mods, pipeline

#: Plot formats, by the file name's suffix.
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


# ----------------------------------------------------------------------------------------------- numbers
def num(x, digits: int = 6) -> float:
    """A plain float, rounded to ``digits`` significant digits (JSON-ready, stable across platforms)."""
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits}g}")


def seeded(seed) -> np.random.Generator:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")
    return np.random.default_rng(int(seed))


def positive(value, name: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an int in minimum … maximum (a count the user chose: bounded, so no run goes on for days)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: expected an integer ≥ {minimum}, got {_short(value)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: expected an integer from {minimum} to {maximum:,}, got {_short(value)}")
    return int(value)


def _short(value) -> str:
    s = repr(value) if not isinstance(value, (int, np.integer)) or abs(int(value)) < 10**30 else f"{int(value):.3e}"
    return s if len(s) <= 40 else s[:39] + "…"


#: The largest counts the experiments accept (their --help and their errors say so): at the defaults' speed the
#: longest run is about 20 minutes (train), 5 (heads), 2 (scale), with a progress bar on the command line.
MAX_STEPS = 100_000
MAX_RUNS = 100
MAX_BATCH = 4096
MAX_SAMPLES = 1 << 20
MAX_KEYS = 1024
#: The most scores the scale experiment computes per d_k (samples × keys): its time and its chunks' memory grow
#: with it (1,048,576 samples of 1,024 keys — each within its own bound — went past 8 GB and would run for hours;
#: 8,388,608 scores take about a minute on 2 cores).
MAX_SCALE_SCORES = 1 << 23


def tick(progress, n: int = 1) -> None:
    """Report ``n`` more units of work done to ``progress`` (a callable, e.g. a tqdm bar's ``update``)."""
    if progress is not None:
        progress(n)


# ----------------------------------------------------------------------------------------------- the model
def padding_block_mask(lengths: np.ndarray, T: int):
    """A block mask for (B, H, 1, T) scores: sentence b's keys 0 … lengths[b]−1 are real (True = may attend)."""
    lengths = np.asarray(lengths)

    def real(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    mm = mods.MaskMod(real, name="padding", params={"lengths": lengths.tolist()})
    return qkv.create_block_mask(mm, len(lengths), None, 1, T)


def softmax_rows(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


class TinyAttention:
    """One attention layer with H heads and a linear readout, its parameters in ``self.params`` (a dict of
    float64 arrays). See the module doc for the computation."""

    NAMES = ("Emb", "Pos", "W_Q", "W_K", "W_V", "W_out", "b")

    def __init__(self, vocab: int, max_len: int, classes: int, *, d_model: int, heads: int, d_head: int,
                 d_value: int | None = None, rng: np.random.Generator):
        self.heads, self.d_head = heads, d_head
        self.d_value = d_head if d_value is None else d_value
        D, HE, HV = d_model, heads * d_head, heads * self.d_value
        self.params = {
            "Emb": rng.standard_normal((vocab, D)) * 0.5,
            "Pos": rng.standard_normal((max_len, D)) * 0.5,
            "W_Q": rng.standard_normal((D, HE)) / math.sqrt(D),
            "W_K": rng.standard_normal((D, HE)) / math.sqrt(D),
            "W_V": rng.standard_normal((D, HV)) / math.sqrt(D),
            "W_out": rng.standard_normal((HV, classes)) / math.sqrt(HV),
            "b": np.zeros(classes),
        }

    # -- forward
    def embed(self, ids: np.ndarray) -> np.ndarray:
        """x = Emb[ids] + Pos: (B, T) ids → (B, T, D)."""
        p = self.params
        return p["Emb"][ids] + p["Pos"][: ids.shape[1]]

    def layer(self, ids, qpos, lengths):
        """The attention layer (:func:`qkv.pipeline.layer`): each sentence's query token at ``qpos`` over all its
        tokens, padding keys masked. Returns ``(concat (B, H·Ev), weights (B, H, 1, T), (q, k, v, x))`` with
        q (B, H, 1, E), k (B, H, T, E), v (B, H, T, Ev) and x (B, T, D) for the backward."""
        p, H = self.params, self.heads
        B, T = ids.shape
        x = self.embed(ids)                                                    # (B, T, D)
        xq = x[np.arange(B), qpos][:, None]                                    # (B, 1, D)
        mask = (np.arange(T)[None, :] < np.asarray(lengths)[:, None])[:, None, None, :]   # (B, 1, 1, T)
        seen = {}

        def attend(q, k, v, rows):
            seen.update(q=q, k=k, v=v)
            return qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_weights=True)

        oc, w = pipeline.layer(xq, p["W_Q"], p["W_K"], p["W_V"], x_kv=x, heads=H, attend=attend)  # (B, 1, H·Ev)
        return oc[:, 0], w, (seen["q"], seen["k"], seen["v"], x)

    def forward(self, ids, qpos, lengths):
        """``(logits (B, C), weights (B, H, 1, T))``."""
        oc, w, _ = self.layer(ids, qpos, lengths)
        logits = oc @ self.params["W_out"] + self.params["b"]
        return logits, w

    def loss(self, ids, qpos, lengths, y) -> float:
        logits, _ = self.forward(ids, qpos, lengths)
        return cross_entropy(logits, y)[0]

    # -- forward and backward
    def loss_and_grads(self, ids, qpos, lengths, y):
        """``(loss, grads, logits, weights)``: the mean cross-entropy and its gradient for every parameter.

        The attention's gradients come from :func:`qkv.flex_attention_backward`; the rest by the chain rule:

            dlogits = (softmax(logits) − onehot(y)) / B
            dW_out = concat(o)ᵀ · dlogits,  db = Σ_b dlogits,  d concat(o) = dlogits · W_outᵀ
            dq, dk, dv = qkv's backward of the attention, given d o
            dW_Q = x_qᵀ · dq,  dW_K = Σ xᵀ · dk,  dW_V = Σ xᵀ · dv
            dx = dk · W_Kᵀ + dv · W_Vᵀ (every position) + dq · W_Qᵀ (the query's position)
            dEmb[id] += dx at every position holding id,  dPos[t] = Σ_b dx[b, t]
        """
        p, H, E, Ev = self.params, self.heads, self.d_head, self.d_value
        B, T = ids.shape
        oc, w, (q, k, v, x) = self.layer(ids, qpos, lengths)                  # oc: the concat (B, H·Ev)
        logits = oc @ p["W_out"] + p["b"]
        loss, probs = cross_entropy(logits, y)
        dlogits = probs.copy()
        dlogits[np.arange(B), y] -= 1.0
        dlogits /= B
        g = {"W_out": oc.T @ dlogits, "b": dlogits.sum(0)}
        do = (dlogits @ p["W_out"].T).reshape(B, H, 1, Ev)
        full = bool(np.all(np.asarray(lengths) == T))
        bm = None if full else padding_block_mask(lengths, T)
        dq, dk, dv = qkv.flex_attention_backward(do, q, k, v, None, bm, backend="reference")
        dq = dq.reshape(B, H * E)                                              # (B, H, 1, E) → (B, H·E)
        dk = dk.transpose(0, 2, 1, 3).reshape(B, T, H * E)                     # (B, H, T, E) → (B, T, H·E)
        dv = dv.transpose(0, 2, 1, 3).reshape(B, T, H * Ev)
        xq = x[np.arange(B), qpos]
        g["W_Q"] = xq.T @ dq
        g["W_K"] = x.reshape(B * T, -1).T @ dk.reshape(B * T, -1)
        g["W_V"] = x.reshape(B * T, -1).T @ dv.reshape(B * T, -1)
        dx = dk @ p["W_K"].T + dv @ p["W_V"].T                                 # (B, T, D)
        dx[np.arange(B), qpos] += dq @ p["W_Q"].T
        onehot = np.zeros((B * T, p["Emb"].shape[0]))                          # (B·T, vocab)
        onehot[np.arange(B * T), ids.reshape(-1)] = 1.0
        dEmb = onehot.T @ dx.reshape(B * T, -1)                                # Σ over the positions of each id
        dPos = np.zeros_like(p["Pos"])
        dPos[:T] = dx.sum(0)
        g["Emb"], g["Pos"] = dEmb, dPos
        return loss, g, logits, w


def cross_entropy(logits: np.ndarray, y: np.ndarray):
    """Mean cross-entropy of integer targets and the softmax probabilities: ``(loss, probs)``."""
    z = logits - logits.max(axis=1, keepdims=True)
    logz = np.log(np.exp(z).sum(axis=1))
    loss = float(np.mean(logz - z[np.arange(len(y)), y]))
    return loss, np.exp(z - logz[:, None])


class Adam:
    """Adam (Kingma & Ba) on a dict of arrays, in place."""

    def __init__(self, params: dict, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8):
        self.params, self.lr, self.b1, self.b2, self.eps = params, lr, beta1, beta2, eps
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.t = 0

    def step(self, grads: dict) -> None:
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for k, g in grads.items():
            self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * g
            self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * g * g
            self.params[k] -= self.lr * (self.m[k] / c1) / (np.sqrt(self.v[k] / c2) + self.eps)


# ----------------------------------------------------------------------------------------------- plots
def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


