"""``qkv lab heads``: "different heads learn different relations" — a task that needs two relations at once,
learned with one head and with two heads of the same total width.

The task. Each token is a letter in a bracket: ``(a``, ``[c``, ``{b``, ``<d`` (4 kinds × 4 letters). A
sequence has 8 tokens; the last token's bracket kind occurs exactly once before it, not in the previous
position — its *matching bracket*. The target, at the last token, is the ordered pair (letter of the previous
token, letter of the matching bracket): 16 classes. One relation is positional (the previous token), the
other is by content (the same bracket kind).

The model (:class:`qkv.lab.common.TinyAttention`): the last token queries the sequence with H heads whose
widths add up to the same total (1 × 8 or 2 × 4), a linear readout of the concatenated heads. Both models
start from the same seed and train on the same batches. One head must put both tokens into one weighted
average, where their letters collide in the same value space (only an uneven split keeps the order); two
heads can each take one relation, and the concat keeps them apart. Reported: the held-out accuracy of each,
and each head's attention after training — on the previous token, on the matching bracket — with its kind.
"""
from __future__ import annotations

import math

import numpy as np

from qkv.locales import t
from qkv.tools.lab import common as C

KINDS = ("(", "[", "{", "<")
LETTERS = ("a", "b", "c", "d")
TOKENS = tuple(k + x for k in KINDS for x in LETTERS)
SEQ_LEN = 8


def sequence(rng: np.random.Generator, T: int = SEQ_LEN):
    """One sequence: ``(tokens, match position, target)``; the target is 4·letter(previous) + letter(match)."""
    ids, m, y = make_data(rng, 1, T)
    return [TOKENS[i] for i in ids[0]], int(m[0]), int(y[0])


def make_data(rng, n: int, T: int = SEQ_LEN):
    """n sequences at once: ``(ids (n, T), match (n,), target (n,))``, as :func:`sequence` draws them."""
    last = rng.integers(4, size=n)
    m = rng.integers(T - 2, size=n)
    kinds = (last[:, None] + 1 + rng.integers(3, size=(n, T))) % 4          # any kind but the last's
    rows = np.arange(n)
    kinds[rows, m] = last
    kinds[:, T - 1] = last
    A = len(LETTERS)
    letters = rng.integers(A, size=(n, T))
    ids = A * kinds + letters                                                 # TOKENS index: kind-major
    return ids, m, A * letters[:, T - 2] + letters[rows, m]


def head_kind(prev: float, match: float) -> str:
    """The relation a head took: ``previous token``, ``matching bracket``, ``both`` or ``other`` (a kind from
    where its weight goes; a head with at least 0.5 on one of them is that kind, 0.25 on both is ``both``)."""
    if prev >= 0.5 and prev >= match:
        return "previous token"
    if match >= 0.5:
        return "matching bracket"
    if prev >= 0.25 and match >= 0.25:
        return "both"
    return "other"


def _train_one(heads: int, *, seed: int, steps: int, batch: int, lr: float, d_model: int, width: int,
               test, log_every: int, progress=None):
    T = SEQ_LEN
    model = C.TinyAttention(len(TOKENS), T, len(LETTERS) ** 2, d_model=d_model, heads=heads, d_head=width // heads,
                            rng=np.random.default_rng([seed, 0]))
    opt = C.Adam(model.params, lr)
    data_rng = np.random.default_rng([seed, 2])                # the same batches for every head count
    qpos = np.full(batch, T - 1)
    lengths = np.full(batch, T)
    curve = []
    for step in range(steps + 1):
        ids, _, y = make_data(data_rng, batch)
        loss, grads, logits, _ = model.loss_and_grads(ids, qpos, lengths, y)
        if step % log_every == 0 or step == steps:
            curve.append({"step": step, "loss": C.num(loss), "accuracy": C.num(np.mean(np.argmax(logits, 1) == y))})
        if step < steps:
            opt.lr = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
            opt.step(grads)
        C.tick(progress)
    ids, match, y = test
    n = len(y)
    logits, w = model.forward(ids, np.full(n, T - 1), np.full(n, T))       # w (n, H, 1, T)
    acc = float(np.mean(np.argmax(logits, 1) == y))
    heads_out = []
    for h in range(heads):
        prev = float(np.mean(w[:, h, 0, T - 2]))
        mt = float(np.mean(w[np.arange(n), h, 0, match]))
        heads_out.append({"head": h, "previous_token": C.num(prev), "matching_bracket": C.num(mt),
                          "kind": head_kind(prev, mt)})
    example = w[0, :, 0, :]                                                 # (H, T): the first test sequence
    return {"heads": heads, "head_width": width // heads, "accuracy": C.num(acc),
            "final_loss": curve[-1]["loss"], "steps": curve, "attention": heads_out,
            "example_weights": [[C.num(x) for x in row] for row in example]}


def run(*, seed: int = 0, runs: int = 3, steps: int = 400, batch: int = 128, lr: float = 0.03, d_model: int = 16,
        width: int = 8, held_out: int = 1000, log_every: int = 10, progress=None) -> dict:
    """Train one head and two heads (the same total width) on the two-relation task; plain data.

    Each model is trained ``runs`` times (seeds ``seed``, ``seed + 1``, …: the initialization and the batches),
    both models on the same batches. Returns ``{"models": [one head, two heads], "example": {"tokens",
    "match"}, "chance", "settings"}``, each model ``{"heads", "head_width", "accuracy" (held out, the mean over
    the runs), "accuracies" (per run), "final_loss", "steps": [{"step", "loss", "accuracy"}], "attention":
    [{"head", "previous_token", "matching_bracket", "kind"}], "example_weights"}`` — the curve, the attention
    and the example from the first run: per head, the mean weight the last token puts on the previous token
    and on its matching bracket (held out). ``runs`` ≤ 100, ``steps`` ≤ 100,000, ``batch`` ≤ 4,096;
    ``progress(n)``, when given, is called after each step of each training (2 · runs · (steps + 1) in all).
    """
    C.seeded(seed)
    runs = C.positive(runs, "runs", maximum=C.MAX_RUNS)
    steps = C.positive(steps, "steps", maximum=C.MAX_STEPS)
    batch = C.positive(batch, "batch", maximum=C.MAX_BATCH)
    width = C.positive(width, "width", minimum=2)
    if width % 2:
        raise ValueError(f"width: expected an even total width (two heads share it), got {width}")
    d_model = C.positive(d_model, "d_model")
    held_out = C.positive(held_out, "held_out")
    log_every = C.positive(log_every, "log_every")
    test = make_data(np.random.default_rng([seed, 1]), held_out)
    models = []
    for heads in (1, 2):
        res = [_train_one(heads, seed=seed + r, steps=steps, batch=batch, lr=lr, d_model=d_model, width=width,
                          test=test, log_every=log_every, progress=progress) for r in range(runs)]
        first = res[0]
        accs = [r["accuracy"] for r in res]
        first["accuracies"] = accs
        first["accuracy"] = C.num(np.mean(accs))
        models.append(first)
    return {"models": models,
            "example": {"tokens": [TOKENS[i] for i in test[0][0]], "match": int(test[1][0])},
            "chance": C.num(1 / len(LETTERS) ** 2),
            "settings": {"seed": seed, "runs": runs, "steps": steps, "batch": batch, "lr": lr, "d_model": d_model,
                         "width": width, "held_out": held_out, "seq_len": SEQ_LEN}}


# ----------------------------------------------------------------------------------------------- presenting
def kind_name(kind: str, lang: str) -> str:
    """A head kind's name in ``lang`` (the heads experiment's rows)."""
    return {"previous token": t("lab.kind_previous", lang), "matching bracket": t("lab.kind_match", lang),
            "both": t("lab.kind_both", lang), "other": t("lab.kind_other", lang)}[kind]


def paragraph(result: dict, lang: str = "en") -> str:
    one, two = result["models"]
    kinds = t("lab.list_sep", lang).join(t("lab.head_kind_item", lang, head=a["head"], kind=kind_name(a["kind"], lang))
                                         for a in two["attention"])
    a1 = one["attention"][0]
    text = t("lab.heads_paragraph", lang, acc1=f"{100 * one['accuracy']:.1f}", acc2=f"{100 * two['accuracy']:.1f}",
             width=result["settings"]["width"], w2=two["head_width"], prev1=f"{a1['previous_token']:.2f}",
             match1=f"{a1['matching_bracket']:.2f}", steps=result["settings"]["steps"],
             chance=f"{100 * result['chance']:.1f}")
    split = sorted(a["kind"] for a in two["attention"]) == ["matching bracket", "previous token"]
    more = t("lab.heads_split" if split else "lab.heads_nosplit", lang, kinds=kinds)
    return text + ("" if lang == "zh" else " ") + more


def table(result: dict, lang: str = "en"):
    heads = [t("lab.col_heads", lang), t("lab.col_accuracy", lang), t("lab.col_head", lang),
             t("lab.col_previous", lang), t("lab.col_match", lang), t("lab.col_kind", lang)]
    rows = []
    for m in result["models"]:
        for a in m["attention"]:
            first = a["head"] == 0
            rows.append([f"{m['heads']} × {m['head_width']}" if first else "",
                         f"{100 * m['accuracy']:.1f}%" if first else "", str(a["head"]),
                         f"{a['previous_token']:.3f}", f"{a['matching_bracket']:.3f}", kind_name(a["kind"], lang)])
    return t("lab.heads_title", lang), heads, rows


__all__ = ["run", "paragraph", "table", "sequence", "head_kind", "TOKENS"]
