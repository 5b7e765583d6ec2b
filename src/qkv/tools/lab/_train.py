"""``qkv lab train``: the seeds' claim, literally — "the matching rule is not written by hand but learned:
in 银行旁边有一棵树，它很高, 它's Q comes to match 树's K".

A synthetic Chinese-flavoured language in which a pronoun must find its noun by agreement:

* nouns carry features — 它 takes the non-human ones (树 草 猫 狗 桌子 床 银行 商店 房子 山), 他 the male humans
  (爸爸 哥哥 男孩 爷爷 叔叔), 她 the female ones (妈妈 姐姐 女孩 奶奶 阿姨), and 老师 医生 学生 (human, gender
  not given) agree with 他 and with 她;
* sentences follow six templates, e.g. ``N1 旁边 有 一 CL N2 ， P 很 A`` (the seed's own shape: 银行 旁边 有 一
  棵 树 ， 它 很 高) or ``N1 和 N2 在 N3 旁边 ， P 很 A``, with distractor nouns between;
* the antecedent of the pronoun P is the **nearest noun before it that agrees** with it (so in 银行旁边有一棵
  树，它很高, where 银行 and 树 both take 它, it is 树). The nouns after the antecedent never agree with P;
  the ones before it agree or not at random (distractors that agree, but are farther).

A one-head attention layer (:class:`qkv.lab.common.TinyAttention`, the pronoun as its query) reads the
sentence and must name the antecedent noun (a classification over the nouns); nothing tells it where to look.
It is trained in NumPy, the attention's gradients from qkv's backward, with Adam. Reported: the training loss,
accuracy and the attention weight from the pronoun to the antecedent along the steps; on held-out sentences
the accuracy and that weight; and, after training, the learned W_Q/W_K run through ``qkv explain`` on
银行旁边有一棵树，它很高 (``result["explain"]``, and ``result["worked_example"]`` is a worked-example
mapping ``qkv explain`` reads: ``qkv lab train --json | jq .worked_example > w.json; qkv explain w.json
--query 它``).
"""
from __future__ import annotations

import types

import math
import re

import numpy as np

from qkv import _checks
from qkv.locales import t
from qkv.tools.lab import common as C

# ----------------------------------------------------------------------------------------------- the language
IT_NOUNS = ("树", "草", "猫", "狗", "桌子", "床", "银行", "商店", "房子", "山")
HE_NOUNS = ("爸爸", "哥哥", "男孩", "爷爷", "叔叔")
SHE_NOUNS = ("妈妈", "姐姐", "女孩", "奶奶", "阿姨")
PERSON_NOUNS = ("老师", "医生", "学生")
NOUNS = IT_NOUNS + HE_NOUNS + SHE_NOUNS + PERSON_NOUNS
PRONOUNS = ("它", "他", "她")
#: the measure word of each noun (一 棵 树, 一 只 猫, 一 位 老师 …; 个 for the rest). Each is shared by two
#: nouns or more, so a measure word never names its noun: the model must look at the noun itself.
CLASSIFIER = types.MappingProxyType({"树": "棵", "草": "棵", "猫": "只", "狗": "只", "桌子": "张", "床": "张", "银行": "家", "商店": "家",
              "房子": "座", "山": "座", "老师": "位", "医生": "位"})
ADJECTIVES = ("高", "大", "好")
#: the templates: N<i> a noun slot, CL<i> the measure word of noun i, P the pronoun, A an adjective
TEMPLATES = (
    "N1 旁边 有 一 CL2 N2 ， P 很 A",
    "N1 和 N2 在 N3 旁边 ， P 很 A",
    "N1 旁边 有 N2 和 N3 ， P 很 A",
    "N1 看见 了 N2 ， P 很 A",
    "在 N1 旁边 ， N2 说 P 很 A",
    "N1 和 N2 旁边 有 一 CL3 N3 ， P 很 A",
)
PAD = "<pad>"
#: the seeds' sentence, in the language's words
SENTENCE = "银行 旁边 有 一 棵 树 ， 它 很 高"


def agrees(pronoun: str, noun: str) -> bool:
    """The agreement rule: 它 ↔ non-human; 他 ↔ human and not female; 她 ↔ human and not male."""
    if pronoun == "它":
        return noun in IT_NOUNS
    if pronoun == "他":
        return noun in HE_NOUNS or noun in PERSON_NOUNS
    return noun in SHE_NOUNS or noun in PERSON_NOUNS


def antecedent(words: list[str]) -> int:
    """The position of the pronoun's antecedent: the nearest noun before the pronoun that agrees with it."""
    p = next(i for i, w in enumerate(words) if w in PRONOUNS)
    for i in range(p - 1, -1, -1):
        if words[i] in NOUNS and agrees(words[p], words[i]):
            return i
    raise ValueError(f"no antecedent for {words[p]!r} in {' '.join(words)!r}")


_SLOT = re.compile(r"^(N\d|CL\d|P|A)$")


def _classifier(noun: str) -> str:
    return CLASSIFIER.get(noun, "个")


def vocabulary() -> list[str]:
    words = [PAD] + [w for tpl in TEMPLATES for w in tpl.split() if not _SLOT.match(w)]
    words += list(NOUNS) + list(PRONOUNS) + list(ADJECTIVES) + sorted(set(CLASSIFIER.values()) | {"个"})
    out: list[str] = []
    for w in words:
        if w not in out:
            out.append(w)
    return out


def sentence(rng: np.random.Generator) -> list[str]:
    """One sentence of the language (a list of words)."""
    tpl = TEMPLATES[rng.integers(len(TEMPLATES))].split()
    slots = sorted({int(w[1:]) for w in tpl if w[0] == "N"})
    pronoun = PRONOUNS[rng.integers(3)]
    agree = [n for n in NOUNS if agrees(pronoun, n)]
    other = [n for n in NOUNS if not agrees(pronoun, n)]
    a = int(rng.integers(len(slots)))                               # the antecedent's slot
    chosen: dict[int, str] = {}
    for i, s in enumerate(slots):
        if i == a:
            pool = agree
        elif i > a:
            pool = other                                            # nearer to the pronoun: must not agree
        else:
            pool = agree if rng.random() < 0.5 else other           # farther: a distractor, agreeing or not
        pool = [n for n in pool if n not in chosen.values()]
        chosen[s] = pool[rng.integers(len(pool))]
    words = []
    for w in tpl:
        if w[0] == "N" and w[1:].isdigit():
            words.append(chosen[int(w[1:])])
        elif w.startswith("CL"):
            words.append(_classifier(chosen[int(w[2:])]))
        elif w == "P":
            words.append(pronoun)
        elif w == "A":
            words.append(ADJECTIVES[rng.integers(len(ADJECTIVES))])
        else:
            words.append(w)
    return words


class Data:
    """Sentences as arrays: ids (N, T) padded, lengths (N,), the pronoun's position, the antecedent's position
    and the target (the antecedent's index in :data:`NOUNS`)."""

    def __init__(self, sentences: list[list[str]], vocab: list[str], T: int):
        index = {w: i for i, w in enumerate(vocab)}
        N = len(sentences)
        self.sentences = sentences
        self.ids = np.zeros((N, T), np.int64)
        self.lengths = np.array([len(s) for s in sentences])
        self.qpos = np.array([next(i for i, w in enumerate(s) if w in PRONOUNS) for s in sentences])
        self.ante = np.array([antecedent(s) for s in sentences])
        self.y = np.array([NOUNS.index(s[a]) for s, a in zip(sentences, self.ante)])
        for n, s in enumerate(sentences):
            self.ids[n, : len(s)] = [index[w] for w in s]

    def batch(self, idx):
        return self.ids[idx], self.qpos[idx], self.lengths[idx], self.y[idx], self.ante[idx]


def make_data(rng, n: int, vocab, T: int) -> Data:
    return Data([sentence(rng) for _ in range(n)], vocab, T)


def max_len() -> int:
    return max(len(tpl.split()) for tpl in TEMPLATES)


def _metrics(model, d: Data, idx=None):
    idx = np.arange(len(d.y)) if idx is None else idx
    ids, qpos, lengths, y, ante = d.batch(idx)
    logits, w = model.forward(ids, qpos, lengths)
    loss = C.cross_entropy(logits, y)[0]
    acc = float(np.mean(np.argmax(logits, 1) == y))
    att = float(np.mean(w[np.arange(len(y)), 0, 0, ante]))
    return loss, acc, att


# ----------------------------------------------------------------------------------------------- the experiment
def run(*, seed: int = 0, steps: int = 400, batch: int = 128, lr: float = 0.03, d_model: int = 16, d_k: int = 8,
        held_out: int = 500, log_every: int = 10, progress=None) -> dict:
    """Train the one-head attention model on the pronoun language; plain data (JSON-ready).

    Returns ``{"steps": [{"step", "loss", "accuracy", "attention"}], "initial_loss", "final_loss",
    "accuracy", "attention_to_antecedent", "chance_attention", "held_out", "explain", "worked_example",
    "settings"}``: the loss, accuracy and mean attention weight from the pronoun to its antecedent on each
    logged training batch (step 0 = before training); ``initial_loss``/``final_loss`` the training loss at the
    first and the last logged step; ``accuracy`` and ``attention_to_antecedent`` on ``held_out`` new sentences;
    ``chance_attention`` the mean of 1 / (sentence length) (uniform attention); ``explain`` the learned model
    on 银行 旁边 有 一 棵 树 ， 它 很 高: 它's scaled scores q·k/√d_k and weights for every word.
    ``steps`` ≤ 100,000 and ``batch`` ≤ 4,096; ``progress(n)``, when given, is called after each step.
    """
    rng = C.seeded(seed)
    steps = C.positive(steps, "steps", minimum=1, maximum=C.MAX_STEPS)
    batch = C.positive(batch, "batch", maximum=C.MAX_BATCH)
    held_out = C.positive(held_out, "held_out")
    log_every = C.positive(log_every, "log_every")
    # each sentence is a few Python objects (~2 KB) before its arrays: a batch beyond memory is an error now,
    # not a list that grows until the machine swaps
    _checks.fits(2048.0 * (batch + held_out), "batch, held_out")
    vocab = vocabulary()
    T = max_len()
    model = C.TinyAttention(len(vocab), T, len(NOUNS), d_model=C.positive(d_model, "d_model"), heads=1,
                            d_head=C.positive(d_k, "d_k"), rng=rng)
    opt = C.Adam(model.params, lr)
    test = make_data(np.random.default_rng([seed, 1]), held_out, vocab, T)      # held-out: its own stream
    data_rng = np.random.default_rng([seed, 2])
    curve = []
    for step in range(steps + 1):
        d = make_data(data_rng, batch, vocab, T)
        ids, qpos, lengths, y, ante = d.batch(np.arange(batch))
        loss, grads, logits, w = model.loss_and_grads(ids, qpos, lengths, y)
        if step % log_every == 0 or step == steps:
            curve.append({"step": step, "loss": C.num(loss),
                          "accuracy": C.num(np.mean(np.argmax(logits, 1) == y)),
                          "attention": C.num(np.mean(w[np.arange(batch), 0, 0, ante]))})
        if step < steps:
            opt.lr = lr * 0.5 * (1 + math.cos(math.pi * step / steps))          # cosine decay to 0
            opt.step(grads)
        C.tick(progress)
    _, acc, att = _metrics(model, test)
    test_loss = _metrics(model, test)[0]
    return {
        "steps": curve,
        "initial_loss": curve[0]["loss"],
        "final_loss": curve[-1]["loss"],
        "accuracy": C.num(acc),
        "attention_to_antecedent": C.num(att),
        "chance_attention": C.num(np.mean(1.0 / test.lengths)),
        "held_out": {"sentences": held_out, "loss": C.num(test_loss)},
        "explain": _explain(model, vocab, T),
        "worked_example": worked_example(model, vocab),
        "settings": {"seed": seed, "steps": steps, "batch": batch, "lr": lr, "d_model": d_model, "d_k": d_k,
                     "nouns": len(NOUNS), "vocabulary": len(vocab), "templates": list(TEMPLATES)},
    }


def worked_example(model, vocab, words: str = SENTENCE) -> dict:
    """The learned model on a sentence as a worked-example mapping (``qkv.explain.examples.from_dict``):
    tokens, X = Emb[ids] + Pos, and the learned W_Q, W_K, W_V."""
    toks = words.split()
    index = {w: i for i, w in enumerate(vocab)}
    ids = np.array([[index[w] for w in toks]])
    X = model.embed(ids)[0]
    p = model.params
    r = lambda a: [[C.num(x, 8) for x in row] for row in np.asarray(a)]        # noqa: E731
    return {"title": "qkv lab train: " + "".join(toks), "tokens": toks, "X": r(X), "W_Q": r(p["W_Q"]),
            "W_K": r(p["W_K"]), "W_V": r(p["W_V"])}


def explain_trace(worked: dict):
    """The worked example run through ``qkv explain``'s machinery: ``(Worked, Trace)``."""
    from qkv.explain import examples as ex

    w = ex.from_dict(worked, name="lab-train")
    return w, ex.run(w)


def _explain(model, vocab, T) -> dict:
    worked = worked_example(model, vocab)
    w, trace = explain_trace(worked)
    toks = w.tokens
    row = toks.index("它")
    scaled = np.asarray(trace["scaled"].array)[row]
    weights = np.asarray(trace["weights"].array)[row]
    q = np.asarray(trace["Q"].array)[row]
    k = np.asarray(trace["K"].array)
    return {"sentence": "".join(toks), "tokens": toks, "query": "它", "query_index": row,
            "antecedent": toks[antecedent(toks)], "top": toks[int(np.argmax(weights))],
            "scaled_scores": [C.num(x) for x in scaled], "weights": [C.num(x) for x in weights],
            "q": [C.num(x) for x in q], "k_antecedent": [C.num(x) for x in k[antecedent(toks)]],
            "d_k": int(q.shape[-1])}


def explain_text(result: dict, lang: str = "en", fmt: str = "text") -> str:
    """``qkv explain --query 它`` on the learned weights (the result's ``worked_example``)."""
    from qkv.explain import explain_query

    w, trace = explain_trace(result["worked_example"])
    return explain_query(trace, w.tokens.index("它"), lang=lang, fmt=fmt, tokens=w.tokens)


# ----------------------------------------------------------------------------------------------- presenting
def paragraph(result: dict, lang: str = "en") -> str:
    ex = result["explain"]
    toks, w, sc = ex["tokens"], ex["weights"], ex["scaled_scores"]
    i = toks.index(ex["antecedent"])
    curve = result["steps"]
    text = t("lab.train_paragraph", lang, steps=result["settings"]["steps"],
             loss0=_f(result["initial_loss"], 3), loss1=_f(result["final_loss"], 3),
             att0=_f(curve[0]["attention"], 2), chance=_f(result["chance_attention"], 2),
             att=_f(result["attention_to_antecedent"], 3), acc=_f(100 * result["accuracy"], 1),
             n=result["held_out"]["sentences"])
    if ex["top"] == ex["antecedent"]:
        # the other noun that agrees with 它 (银行 in the seeds' sentence): the one the model had to pass over
        j = next((k for k, x in enumerate(toks) if x in NOUNS and k != i and agrees(ex["query"], x)), None)
        j = j if j is not None else max((k for k in range(len(toks)) if k != i), key=lambda k: w[k])
        more = t("lab.train_explain_hit", lang, sentence=ex["sentence"], ante=toks[i], other=toks[j],
                 s_ante=_f(sc[i], 2), s_other=_f(sc[j], 2), w_ante=_g(w[i]), w_other=_g(w[j]))
    else:
        more = t("lab.train_explain_miss", lang, sentence=ex["sentence"], top=ex["top"],
                 w_top=_g(max(w)), ante=toks[i], w_ante=_g(w[i]))
    return text + " " + more if lang != "zh" else text + more


def table(result: dict, lang: str = "en"):
    """``(title, headers, rows)`` for the command line: the logged steps."""
    heads = [t("lab.col_step", lang), t("lab.col_loss", lang), t("lab.col_accuracy", lang),
             t("lab.col_attention", lang)]
    rows = [[str(s["step"]), _f(s["loss"], 4), _f(s["accuracy"], 3), _f(s["attention"], 3)]
            for s in _thin(result["steps"], 12)]
    return t("lab.train_title", lang), heads, rows


def _thin(rows, n: int):
    if len(rows) <= n:
        return rows
    idx = sorted(set(np.linspace(0, len(rows) - 1, n).round().astype(int).tolist()))
    return [rows[i] for i in idx]


def _f(x, digits: int) -> str:
    return f"{x:.{digits}f}".replace("-", "−")


__all__ = ["run", "paragraph", "table", "explain_text", "agrees", "antecedent", "sentence", "vocabulary",
           "NOUNS", "PRONOUNS", "TEMPLATES", "SENTENCE"]


def _g(x) -> str:
    """A weight: 4 decimals, or 2 significant digits when smaller than 0.001."""
    return f"{x:.4f}" if x >= 1e-3 or x == 0 else f"{x:.2g}"
