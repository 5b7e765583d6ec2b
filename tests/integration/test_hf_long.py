"""Long inputs (issue 41, part 4): qkv.hf.record's summaries streamed without the N² weights, held to eager's full
weights on a few hundred tokens (pooling active: 256 cells < T); the limit of record without rows; and
`qkv view --hf DIR --text-file FILE [--rows …]`: its bad input as one line, its page's numbers equal to Python's."""
import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qkv.hf  # noqa: E402
from qkv.hf import _summary  # noqa: E402
from qkv.viz import heads as viz_heads  # noqa: E402

qkv.hf.register()

VOCAB = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096)
T = 300                                             # > POOL (256): the pooled cells cover 1 or 2 rows each


def _config(name):
    from transformers import BertConfig, Gemma2Config, GptOssConfig, LlamaConfig, MistralConfig
    return {
        "llama": lambda: LlamaConfig(**SMALL),
        "mistral": lambda: MistralConfig(**SMALL, sliding_window=7),
        "gemma2": lambda: Gemma2Config(**SMALL, head_dim=16, sliding_window=7, attn_logit_softcapping=3.0,
                                       query_pre_attn_scalar=24),
        "gptoss": lambda: GptOssConfig(**SMALL, head_dim=16, sliding_window=7, num_local_experts=2,
                                       num_experts_per_tok=1),
        "bert": lambda: BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=96, max_position_embeddings=512, attention_probs_dropout_prob=0.0,
                                   hidden_dropout_prob=0.0),
    }[name]()


def _model(name, seed=0, sharpen=1.0):
    """A tiny random model in eager; ``sharpen`` scales the query projections so that heads pick distinct keys
    (random heads at 300 tokens are all long-range: the kinds would not tell anything apart)."""
    from transformers import AutoModel, AutoModelForCausalLM
    torch.manual_seed(seed)
    cls = AutoModel if name == "bert" else AutoModelForCausalLM
    m = cls.from_config(_config(name), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("sinks"):
                p.normal_(0.0, 1.0)
            if n.endswith(("q_proj.weight", "query.weight")):
                p.mul_(sharpen)
    return m


def _ids(seed=1, n=T):
    """Token ids with repeats (``same``) and a special token of the tokens given (``<s>`` at 0 and n // 2: sinks)."""
    ids = torch.from_numpy(np.random.default_rng(seed).integers(2, 12, size=(1, n)))
    ids[0, 0] = ids[0, n // 2] = 1
    return ids


def _tokens(ids):
    return ["<s>" if i == 1 else f"w{i}" for i in ids[0].tolist()]


def _reference(A, tokens):
    """The summaries from one layer's full weights A (H, T, T) float64: entropy, mean distance, sink share,
    head_kinds' scores and labels."""
    i = np.arange(A.shape[-1])
    ent = -np.where(A > 0, A * np.log(np.where(A > 0, A, 1.0)), 0.0).sum(-1).mean(-1)
    dist = (A * (i[:, None] - i[None, :])).sum(-1).mean(-1)
    return ent, dist, A[:, :, 0].mean(-1), viz_heads.head_kinds([A], tokens)


def _max_pool(A, re, ce):
    return np.maximum.reduceat(np.maximum.reduceat(A, re[:-1], axis=-2), ce[:-1], axis=-1)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "gptoss", "bert"])
def test_summaries_equal_those_of_eagers_full_weights(name):
    """Entropy, mean distance and sink share within 1e-5 (distance relative), head_kinds' scores within 1e-6 and
    the same labels, the pooled map equal to a max-pool of the full weights, the exact rows equal eager's."""
    m = _model(name, sharpen=4.0)
    ids = _ids()
    tokens = _tokens(ids)
    with torch.no_grad():
        full = [a[0].double().numpy() for a in m(input_ids=ids, output_attentions=True).attentions]
    rows = [0, 7, 151, -1]                                                # (151: just after a sink)
    with qkv.hf.record(m, rows=rows, summaries=_summary.Summaries(tokens=tokens)) as rec, torch.no_grad():
        m(input_ids=ids)
    assert m.config._attn_implementation == "eager"
    kinds = set()
    for layer, A in enumerate(full):
        s = rec.summaries[layer]
        ent, dist, sink, hk = _reference(A, tokens)
        np.testing.assert_allclose(s.entropy[0], ent, atol=1e-5)
        np.testing.assert_allclose(s.distance[0], dist, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(s.sink[0], sink, atol=1e-6)
        for kind in viz_heads.KINDS:
            np.testing.assert_allclose(s.scores[kind][0], hk.scores[kind][0], atol=1e-6, err_msg=kind)
        assert s.kind[0].tolist() == hk.kind[0].tolist()
        kinds |= set(hk.kind[0].tolist())
        assert s.pooled.shape == (1, 4, 256, 256) and s.row_edges[-1] == T and s.col_edges[-1] == T
        np.testing.assert_allclose(s.pooled[0], _max_pool(A, s.row_edges, s.col_edges), atol=1e-6)
        np.testing.assert_allclose(rec.weights[layer][0], A[:, [0, 7, 151, T - 1]], atol=1e-6)
        assert s.causal == (name != "bert")
    assert kinds <= {"long_range", "mixed"}                # random heads: designed ones are the next test's


def _designed_heads(T=300, E=16, seed=0):
    """q, k (1, 4, T, E) whose causal heads are, by construction: 0 same (each query on its own key), 1 previous
    (query i is key i − 1), 2 sink (every query on key 0), 3 long_range (q = 0: uniform over the keys seen, most
    of them far)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, 4, T, E)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q = np.zeros_like(k)
    q[0, 0] = 12 * k[0, 0]
    q[0, 1, 1:] = 12 * k[0, 1, :-1]
    k[0, 2, 0] = 3 * np.ones(E, np.float32) / np.sqrt(E)
    q[0, 2] = 4 * np.ones(E, np.float32) / np.sqrt(E)
    return q, k


def test_designed_heads_get_head_kinds_own_labels_from_the_streamed_sums():
    """Every kind head_kinds knows, built on purpose; the labels and scores from the sums are head_kinds' on the
    full weights (tokens with repeats and a special token, blocks of 64 rows, pool 128 < T)."""
    from qkv import mods
    from qkv.hf._attention import Spec
    from qkv.hf._mask import Mask
    q, k = _designed_heads()
    spec = Spec()
    spec.mask = Mask(mods.causal(), 1, T, T, per_batch=False, is_causal=True)
    spec.dense, spec.score_mod, spec.sinks, spec.scale, spec.enable_gqa = None, None, None, 1.0, False
    tokens = _tokens(_ids())
    s = _summary.summarize(spec, q, k, np.arange(4), _summary.Summaries(tokens=tokens, pool=128, block=64))
    A = spec.weights(q, k)[0].astype(np.float64)                           # (4, T, T)
    ent, dist, sink, hk = _reference(A, tokens)
    assert hk.kind[0].tolist() == ["same", "previous", "sink", "long_range"]
    assert s.kind[0].tolist() == hk.kind[0].tolist()
    for kind in viz_heads.KINDS:
        np.testing.assert_allclose(s.scores[kind][0], hk.scores[kind][0], atol=1e-6, err_msg=kind)
    np.testing.assert_allclose(s.entropy[0], ent, atol=1e-5)
    np.testing.assert_allclose(s.distance[0], dist, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(s.sink[0], sink, atol=1e-6)
    np.testing.assert_allclose(s.pooled[0], _max_pool(A, s.row_edges, s.col_edges), atol=1e-6)
    assert s.distance[0, 3] == pytest.approx((T - 1) / 4, rel=1e-5)           # uniform: row i's mean is i / 2
    assert s.entropy[0, 3] == pytest.approx(np.mean(np.log(np.arange(1, T + 1))), rel=1e-5)   # log(i + 1)
    assert s.sink[0, 2] > 0.5 and s.sink[0, 3] == pytest.approx(np.mean(1 / np.arange(1, T + 1)), rel=1e-5)
    rows = np.array([3, 5, 40])                                             # a block: keys 0 … 40 computed
    w = _summary.block_weights(spec, q, k, 2, rows)
    assert w.shape == (1, 3, 41)
    np.testing.assert_array_equal(w, spec.weights(q, k, [2], rows)[:, 0, :, :41])
    assert not spec.weights(q, k, [2], rows)[:, 0, :, 41:].any()


def test_many_small_blocks_and_a_coarse_pool_give_the_same_summaries():
    """Blocks of 50 rows and a 64-cell pool (each cell 4–5 rows): the block boundaries change nothing."""
    m = _model("llama", sharpen=4.0)
    ids = _ids()
    with torch.no_grad():
        full = [a[0].double().numpy() for a in m(input_ids=ids, output_attentions=True).attentions]
    with qkv.hf.record(m, summaries=_summary.Summaries(pool=64, block=50)) as rec, torch.no_grad():
        m(input_ids=ids)
    assert rec.weights == {} and rec.traces == {}                          # summaries alone: no L × S weights
    for layer, A in enumerate(full):
        s = rec.summaries[layer]
        ent, dist, sink, hk = _reference(A, None)
        np.testing.assert_allclose(s.entropy[0], ent, atol=1e-5)
        np.testing.assert_allclose(s.distance[0], dist, rtol=1e-5, atol=1e-4)
        assert s.kind[0].tolist() == hk.kind[0].tolist()
        assert s.pooled.shape == (1, 4, 64, 64) and set(np.diff(s.row_edges).tolist()) == {4, 5}
        np.testing.assert_allclose(s.pooled[0], _max_pool(A, s.row_edges, s.col_edges), atol=1e-6)


def test_a_sharp_diagonal_survives_max_pooling_where_a_mean_fades_it():
    """A head that attends to its own token: every diagonal cell of the pooled map holds a weight near 1."""
    from qkv.hf._attention import Spec
    rng = np.random.default_rng(0)
    L, E = 1000, 64
    k = rng.standard_normal((1, 1, L, E)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)                         # unit keys; each query 20 × its own
    spec = Spec()
    spec.mask, spec.dense, spec.score_mod, spec.sinks, spec.scale, spec.enable_gqa = None, None, None, None, 1.0, False
    s = _summary.summarize(spec, 20 * k, k, [0], _summary.Summaries(pool=100))
    W = spec.weights(20 * k, k)[0, 0].astype(np.float64)                  # (L, L), the reference
    assert np.diag(W).min() > 0.5                                          # sharp: each query on itself
    pooled = s.pooled[0, 0]
    np.testing.assert_allclose(pooled, _max_pool(W, s.row_edges, s.col_edges), atol=1e-6)
    assert np.diag(pooled).min() > 0.5 and W.reshape(100, 10, 100, 10).mean((1, 3)).diagonal().max() < 0.2
    assert s.kind[0, 0] == "same" and not s.causal


def test_the_classifier_repeated_in_qkv_hf_is_head_kinds_own():
    """qkv.hf may not import qkv.viz (the layers contract): its copy of the thresholds and words must agree."""
    assert _summary.PATTERN_MIN == viz_heads.PATTERN_MIN and _summary.BROAD_MIN == viz_heads.BROAD_MIN
    assert _summary.KINDS == viz_heads.KINDS and _summary.SPECIAL_TOKENS == viz_heads.SPECIAL_TOKENS
    assert _summary.NEAR == 4
    scores = {k: np.array([[0.1, 0.6, 0.2, 0.3]]) for k in _summary.KINDS}
    scores["broad"] = np.array([[0.9, 0.1, 0.86, 0.5]])
    scores["sink"] = np.array([[0.2, 0.7, 0.49, 0.1]])
    assert _summary.label(scores).tolist() == [["broad", "sink", "broad", "mixed"]]


def test_record_without_rows_over_the_limit_says_what_it_needs_and_offers_rows_or_summaries(monkeypatch):
    m = _model("llama")
    ids = _ids(n=64)
    monkeypatch.setattr(_summary, "MAX_WEIGHT_BYTES", 4 * 4 * 64 * 64 - 1)     # one layer's weights: 1 byte over
    with pytest.raises(ValueError) as e, torch.no_grad():
        with qkv.hf.record(m):
            m(input_ids=ids)
    msg = str(e.value)
    assert msg.startswith("rows: ") and "(1, 4, 64, 64) float32" in msg and "rows=[" in msg
    assert "summaries=True" in msg and "0.0 GiB" in msg
    with qkv.hf.record(m, rows=[-1]) as rec, torch.no_grad():               # rows, or summaries, pass
        m(input_ids=ids)
    assert rec.weights[1].shape == (1, 4, 1, 64)
    with qkv.hf.record(m, summaries=True) as rec, torch.no_grad():
        m(input_ids=ids)
    assert sorted(rec.summaries) == [0, 1] and rec.weights == {}
    monkeypatch.setattr(_summary, "MAX_WEIGHT_BYTES", 4 * 4 * 64 * 64)        # exactly at the limit: allowed
    with qkv.hf.record(m) as rec, torch.no_grad():
        m(input_ids=ids)
    assert rec.weights[0].shape == (1, 4, 64, 64)


def test_the_default_limit_refuses_32768_tokens_of_four_heads():
    with pytest.raises(ValueError, match=r"16\.0 GiB .*\(\(1, 4, 32768, 32768\) float32\), over record's limit of 1 "
                                         r"GiB"):
        _summary.check_weights(0, 1, 4, 32768, 32768)
    _summary.check_weights(0, 1, 4, 8192, 8192)                                 # exactly 1 GiB: allowed


def test_bad_summaries_options_are_errors_naming_them():
    with pytest.raises(TypeError, match="summaries: expected True, False or qkv.hf.Summaries"):
        _summary.options("yes")
    with pytest.raises(ValueError, match="pool: expected a positive integer, got 0"):
        _summary.Summaries(pool=0)
    with pytest.raises(TypeError, match="tokens: expected None or a list of str"):
        _summary.Summaries(tokens="abc")


def test_summarize_holds_blocks_of_rows_never_the_whole_map():
    """tracemalloc's peak while summarising 4,096 × 4,096 of one head stays under a quarter of its weights."""
    import tracemalloc

    from qkv.hf._attention import Spec
    from qkv.hf._mask import Mask
    from qkv import mods
    rng = np.random.default_rng(0)
    L, E = 4096, 16
    q, k = (rng.standard_normal((1, 1, L, E)).astype(np.float32) for _ in range(2))
    spec = Spec()
    spec.mask = Mask(mods.causal(), 1, L, L, per_batch=False, is_causal=True)
    spec.dense, spec.score_mod, spec.sinks, spec.scale, spec.enable_gqa = None, None, None, 0.25, False
    tracemalloc.start()
    s = _summary.summarize(spec, q, k, [0], _summary.Summaries(block=128))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < L * L * 4 / 4, peak
    assert s.causal and s.pooled.shape == (1, 1, 256, 256)
    w = spec.weights(q, k, rows=np.array([0, 1000, L - 1]))[0, 0]
    re, ce = s.row_edges, s.col_edges
    for r in (0, 1000, L - 1):                                               # the pooled cell holds the row's max
        a = np.searchsorted(re, r, side="right") - 1
        b = int(np.argmax(w[[0, 1000, L - 1].index(r)]))
        assert s.pooled[0, 0, a, np.searchsorted(ce, b, side="right") - 1] >= w[[0, 1000, L - 1].index(r)].max()


# --------------------------------------------------------------------------------------------- the CLI and page
WORDS = "[PAD] [UNK] <s> the cat sat on mat and it was tired because animal didn't cross street 我 爱 吃 苹果 。".split()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama (hidden 64, 2 layers, 4 heads, context 4,096) saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("tiny-llama-long")
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(**dict(SMALL, vocab_size=len(WORDS))))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("q_proj.weight"):
                p.mul_(4.0)
    m.save_pretrained(d)
    _tokenizer().save_pretrained(d)
    return d


def text_of(n: int, zh: bool = False, seed: int = 0) -> str:
    words = ["我", "爱", "吃", "苹果", "。"] if zh else WORDS[3:16]
    rng = np.random.default_rng(seed)
    return " ".join(words[i] for i in rng.integers(0, len(words), n))


def page_data(path) -> dict:
    text = path.read_text(encoding="utf-8")
    return json.loads(re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', text, re.S).group(1))


def test_qkv_view_text_file_writes_the_long_view_with_pythons_numbers(folder, tmp_path, capsys):
    from cli_checks import run
    from qkv.hf._summary import Summaries
    from qkv.viz.page_maps import decode_maps
    src = tmp_path / "story.txt"
    src.write_text(text_of(600), encoding="utf-8")
    page = tmp_path / "p.html"
    code, out, err = run(capsys, "view", "--hf", folder, "--text-file", src, "--rows", "0,100,-1", "-o", page)
    assert code == 0, err
    D = page_data(page)["long"]
    assert D["T"] == 600 and D["rows"] == [0, 100, 599] and D["layers"] == 2 and D["heads"] == 4
    assert page_data(page)["first"] == "long" and page_data(page)["playground"] is None
    m = qkv.hf.load(folder)
    ids = torch.tensor([m.hf_tokenizer(src.read_text(encoding="utf-8"))["input_ids"]])
    tokens = m._shown(ids[0].numpy())
    assert D["tokens"] == tokens
    with qkv.hf.record(m.model, rows=[0, 100, 599], summaries=Summaries(tokens=tokens)) as rec, torch.no_grad():
        m.model(input_ids=ids)
    pooled, exact = decode_maps(D["pooled"]), decode_maps(D["exact"])
    for layer in range(2):
        s = rec.summaries[layer]
        assert D["summary"]["entropy"][layer] == np.round(s.entropy[0], 4).tolist()
        assert D["summary"]["distance"][layer] == np.round(s.distance[0], 4).tolist()
        assert D["summary"]["sink"][layer] == np.round(s.sink[0], 4).tolist()
        assert D["summary"]["kind"][layer] == s.kind[0].tolist()
        for h in range(4):
            k = pooled[layer * 4 + h]
            np.testing.assert_array_equal(k, np.rint(s.pooled[0, h].astype(np.float64) * 1000))
            np.testing.assert_array_equal(exact[layer * 4 + h],
                                          np.rint(rec.weights[layer][0, h].astype(np.float64) * 1000))
    assert D["row_edges"] == s.row_edges.tolist()
    assert "story.txt" in page.read_text(encoding="utf-8").split("<title>")[1].split("</title>")[0]


def test_qkv_view_text_file_bad_input_is_one_line(folder, tmp_path, capsys):
    from cli_checks import one_line, run
    good = tmp_path / "good.txt"
    good.write_text(text_of(50), encoding="utf-8")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("the cat sat on the mat, café".encode("latin-1"))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    long = tmp_path / "long.txt"
    long.write_text(text_of(4097), encoding="utf-8")
    page = tmp_path / "p.html"
    cases = [
        (["--hf", folder, "--text-file", tmp_path / "missing.txt"], r"--text-file: cannot read .*missing\.txt.*: No such file"),
        (["--hf", folder, "--text-file", latin], r"--text-file: .*latin1\.txt' is not UTF-8 text \(byte 0xe9 at offset 27\)"),
        (["--hf", folder, "--text-file", empty], r"--text-file: .* holds no text"),
        (["--hf", folder, "--text-file", long], r"--text-file: 4,097 tokens, over the model's context of 4,096 positions"),
        (["--hf", folder, "--text-file", good, "--rows", "0,50"], r"--rows: expected query rows in -50 … 49 \(the text has 50 tokens\), got \[50\]"),
        (["--hf", folder, "--text-file", good, "--rows", "1,a"], r"--rows: expected query rows as integers"),
        (["--hf", folder, "--rows", "1"], r"--rows: works with --text-file FILE"),
        (["--text-file", good], r"--text-file: works with --hf DIR"),
        (["--hf", folder, "--text-file", good, "--text", "the cat"], r"give either --text-file FILE or --text TEXT"),
        (["--hf", folder, "--text-file", good, "--compare", folder], r"give either --text-file FILE or --compare DIR"),
        (["--hf", folder, "--model", "minilm", "--text-file", good], r"give either --model NAME or --hf DIR"),
    ]
    for args, pattern in cases:
        code, out, err = run(capsys, "view", *args, "-o", page)
        one_line(code, err, pattern)
        assert not page.exists()


def test_a_text_over_32768_tokens_is_refused_before_the_forward():
    from qkv.viz import page_long

    class Tok:
        def __call__(self, texts, **kw):
            return {"input_ids": np.zeros((1, 40_000), np.int64)}

    class Model:
        hf_tokenizer = Tok()
        config = type("C", (), {"context_length": 131_072})()

    with pytest.raises(ValueError, match=r"^text: 40,000 tokens, over the long-input view's limit of 32,768"):
        page_long.encode(Model(), "the cat")


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_a_padded_batch_is_summarised_row_by_row(name):
    """Two texts, the second right-padded by 40 keys (masked): each batch row's summaries are its own weights'."""
    m = _model(name, sharpen=4.0)
    ids = torch.cat([_ids(1), _ids(2)])
    mask = torch.ones_like(ids)
    mask[1, -40:] = 0
    with torch.no_grad():
        full = [a.double().numpy() for a in m(input_ids=ids, attention_mask=mask, output_attentions=True).attentions]
    with qkv.hf.record(m, summaries=True) as rec, torch.no_grad():
        m(input_ids=ids, attention_mask=mask)
    for layer, A in enumerate(full):                                       # A: (2, H, T, T)
        s = rec.summaries[layer]
        assert s.entropy.shape == (2, 4) and s.pooled.shape == (2, 4, 256, 256)
        for b in range(2):
            ent, dist, sink, hk = _reference(A[b], None)
            np.testing.assert_allclose(s.entropy[b], ent, atol=1e-5)
            np.testing.assert_allclose(s.distance[b], dist, rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(s.sink[b], sink, atol=1e-6)
            np.testing.assert_allclose(s.pooled[b], _max_pool(A[b], s.row_edges, s.col_edges), atol=1e-6)
        assert np.abs(s.pooled[1, :, :, -30:]).max() == 0                  # the masked keys hold no weight
