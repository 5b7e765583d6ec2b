"""Issue 41, parts 3, 5 and 6: the generation view of any causal transformers model, the comparison of two
checkpoints (qkv.hf.compare) and the page that opens on what was asked — on tiny random models saved with
save_pretrained (Llama, Qwen2, Gemma2 with a sliding window; BERT as the encoder), nothing downloaded.

References: transformers' eager attention (``generate(…, output_attentions=True, return_dict_in_generate=True)``
and ``model(…, output_attentions=True)``), the Jensen–Shannon divergence written out here in NumPy, and the page
data decoded back (``decode_maps``)."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qkv.hf  # noqa: E402
from qkv import viz  # noqa: E402
from qkv.viz import page_hf  # noqa: E402,F401  (viz.page_hf)
from qkv.viz.page_maps import decode_maps, quantize  # noqa: E402
from test_hf import WORDS, _configs, _tokenizer  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

DECODERS = ("llama", "qwen2", "gemma2", "gpt2")
#: A chat template written with the word-level vocabulary's words: the user's message, then "and it".
CHAT = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}and it{% endif %}"


# ------------------------------------------------------------------------------------------ folders
def byte_level_tokenizer():
    """A byte-level BPE tokenizer trained here on a few words: what a Qwen2 folder holds. (transformers'
    AutoTokenizer gives a Qwen2 folder its own Qwen2Tokenizer whatever tokenizer_config.json says — qwen2 is in
    its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS — which reads a word-level vocabulary as no tokens at all.)"""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([" ".join(WORDS[2:])] * 50, vocab_size=300, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")


def save_decoder(path, name: str = "llama", *, seed: int = 0, chat: str | None = None, layers: int = 2,
                 perturb_layer: int | None = None):
    """A tiny random decoder of ``_configs()[name]`` saved in ``path`` with its tokenizer (the word-level one of
    tests/integration/test_hf.py; Qwen2: a byte-level BPE); ``perturb_layer``: that layer's q_proj moved (a "fine-tuned"
    checkpoint of the same model)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    tok = byte_level_tokenizer() if name == "qwen2" else _tokenizer()
    c = GPT2Config(n_embd=64, n_head=4, n_positions=256) if name == "gpt2" else _configs()[name]
    c.vocab_size, c.num_hidden_layers = len(tok), layers
    if hasattr(c, "layer_types") and c.layer_types is not None:
        c.layer_types = c.layer_types[:layers]
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(c).float().eval()
    if perturb_layer is not None:
        g = torch.Generator().manual_seed(99)
        with torch.no_grad():
            w = m.model.layers[perturb_layer].self_attn.q_proj.weight
            w.add_(0.5 * torch.randn(w.shape, generator=g))
    m.save_pretrained(path)
    if chat is not None:
        tok.chat_template = chat
    tok.save_pretrained(path)
    return path


def save_bert(path):
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    c = BertConfig(vocab_size=len(WORDS), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=96)
    BertModel(c).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf41")
    out = {name: save_decoder(root / f"tiny-{name}", name) for name in DECODERS}
    out["tuned"] = save_decoder(root / "tiny-llama-tuned", "llama", perturb_layer=1)
    out["deeper"] = save_decoder(root / "tiny-llama-deeper", "llama", layers=3)
    out["chat"] = save_decoder(root / "tiny-chat", "llama", chat=CHAT)
    out["bert"] = save_bert(root / "tiny-bert")
    return out


def eager(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()


def embedded(page: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)[1])


# ------------------------------------------------------------------------------------------ generation
@pytest.mark.parametrize("name", DECODERS)
def test_each_generated_tokens_row_is_the_row_its_step_computed_in_eager(folders, name):
    """One forward pass over prompt + continuation (qkv.hf.record) against eager's own generation attentions:
    step k of eager's generate feeds generated token k − 1 (the query at P + k − 1) — its row is ours within
    1e-6. A sliding window's cache keeps only the window's keys: ours holds exact zeros before them."""
    from qkv.hf.generation_rows import generate, sequence_attentions

    m = qkv.hf.load(folders[name])
    g = generate(m, "the cat sat on", max_new_tokens=6)
    ids = g.prompt_ids + g.ids
    P, G = len(g.prompt_ids), len(g.ids)
    ours = list(sequence_attentions(m, ids))                             # per layer (H, T, T)
    ref = eager(folders[name])
    x = torch.tensor([g.prompt_ids])
    with torch.no_grad():
        out = ref.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False,
                           output_attentions=True, return_dict_in_generate=True, pad_token_id=0)
    assert out.sequences[0].tolist() == ids                              # the same continuation (qkv vs eager)
    assert len(out.attentions) == G >= 2
    compared = 0
    for k in range(1, G):
        q = P + k - 1                                                    # the query of eager's step k
        for layer, a in enumerate(out.attentions[k]):
            row = a[0, :, 0].numpy()                                     # (H, keys the cache holds)
            S = row.shape[-1]
            mine = ours[layer][:, q, :q + 1]
            np.testing.assert_allclose(mine[:, q + 1 - S:], row, rtol=0, atol=1e-6)
            assert not mine[:, :q + 1 - S].any()
            compared += 1
    assert compared == (G - 1) * len(ours)
    with torch.no_grad():                                                # and the last token's row: a full pass
        full = ref(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    for layer, a in enumerate(full):
        np.testing.assert_allclose(ours[layer][:, -1], a[0, :, -1].numpy(), rtol=0, atol=1e-6)


def test_the_generation_data_has_the_smollm2_views_shape_and_its_rows(folders):
    m = qkv.hf.load(folders["llama"])
    d = viz.hf_generation_data(m, "the cat sat on", max_new_tokens=5)
    from qkv.hf.generation_rows import sequence_attentions
    ids = [WORDS.index(t) for t in d["tokens"]]
    layers = list(sequence_attentions(m, ids))
    P, L, H = d["prompt_len"], d["layers"], d["heads"]
    assert (P, L, H) == (4, 2, 4) and d["tokens"][:P] == ["the", "cat", "sat", "on"]
    steps = decode_maps(d["steps"])
    assert len(steps) == len(ids) - P
    for s, k in enumerate(steps):                                        # (L·H, P + s + 1) per step
        want = np.concatenate([a[:, P + s, :P + s + 1] for a in layers])
        np.testing.assert_array_equal(k, quantize(want))
    assert d["model"]["source"] == d["source"] == "qkv.hf" and d["model"]["decoder"]
    page = viz.render_page({"generation": d, "first": "generation"})
    assert re.search(r"<title>tiny-llama · the cat sat on</title>", page)
    assert set(embedded(page)["generation"]) >= {"name", "prompt", "text", "tokens", "prompt_len", "steps"}


def test_sampling_is_seeded_and_leaves_torchs_generator_as_it_was(folders):
    from qkv.hf.generation_rows import generate
    m = qkv.hf.load(folders["llama"])
    torch.manual_seed(5)
    before = torch.random.get_rng_state()
    runs = [generate(m, "the cat", max_new_tokens=8, temperature=1.5, seed=s).ids for s in (1, 1, 2)]
    assert torch.equal(torch.random.get_rng_state(), before)
    assert runs[0] == runs[1] and runs[0] != runs[2]
    greedy = generate(m, "the cat", max_new_tokens=8)
    with torch.no_grad():                                              # greedy: eager's own generate
        ref = eager(folders["llama"]).generate(torch.tensor([greedy.prompt_ids]), max_new_tokens=8,
                                               do_sample=False, pad_token_id=0)
    assert ref[0, len(greedy.prompt_ids):].tolist() == greedy.ids


def test_chat_uses_the_folders_template_in_qkvs_sandbox_not_transformers(folders, monkeypatch):
    m = qkv.hf.load(folders["chat"])
    monkeypatch.setattr(type(m.hf_tokenizer), "apply_chat_template",
                        lambda *a, **k: pytest.fail("transformers' renderer ran"))
    d = viz.hf_generation_data(m, "the cat", max_new_tokens=2, chat=True)
    assert d["tokens"][:d["prompt_len"]] == ["the", "cat", "and", "it"] and d["chat"] is True
    assert d["model"]["text"] == "the cat and it"
    m.hf_tokenizer.chat_template = "{{ bos_token }}|{% for m in messages %}{{ m['content'] }}{% endfor %}|{{ eos_token }}"
    assert viz.page_hf.chat_prompt(m, "the cat") == "|the cat|"            # no BOS/EOS: undefined, not "None"
    m.hf_tokenizer.bos_token = "the"
    assert viz.page_hf.chat_prompt(m, "the cat") == "the|the cat|"
    m.hf_tokenizer.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError, match=r"^tiny-chat: tokenizer.chat_template: refused by the sandbox"):
        viz.hf_generation_data(m, "the cat", max_new_tokens=2, chat=True)
    m.hf_tokenizer.chat_template = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    with pytest.raises(ValueError, match=r"^tiny-chat: tokenizer.chat_template: stopped"):
        viz.hf_generation_data(m, "the cat", max_new_tokens=2, chat=True)


def test_what_cannot_generate_is_a_value_error_naming_the_argument(folders):
    bert = qkv.hf.load(folders["bert"])
    with pytest.raises(ValueError, match=r"^model: expected a causal language model .* got 'bert'"):
        viz.hf_generation_data(bert, "the cat")
    m = qkv.hf.load(folders["llama"])
    for kw, pattern in (({"max_new_tokens": 0}, r"^max_new_tokens: expected an integer >= 1, got 0"),
                        ({"max_new_tokens": 300}, r"^max_new_tokens: expected 1 … 254 \(the context holds 256"),
                        ({"temperature": -1.0}, r"^temperature: expected 0"),
                        ({"chat": True}, r"^chat: tiny-llama has no chat template")):
        with pytest.raises(ValueError, match=pattern):
            viz.hf_generation_data(m, "the cat", **kw)
    with pytest.raises(ValueError, match=r"^prompt: expected a non-empty text"):
        viz.hf_generation_data(m, "  ")


# ------------------------------------------------------------------------------------------ compare
def js_bits(p: np.ndarray, q: np.ndarray) -> float:
    """The Jensen–Shannon divergence of two rows in bits, written out term by term (0·log 0 = 0)."""
    total = 0.0
    for pj, qj in zip(p.astype(np.float64), q.astype(np.float64)):
        m = (pj + qj) / 2
        if pj > 0:
            total += 0.5 * pj * np.log2(pj / m)
        if qj > 0:
            total += 0.5 * qj * np.log2(qj / m)
    return total


def test_compare_is_the_js_divergence_of_eagers_weights_and_ranks_the_perturbed_layer_first(folders):
    a, b = eager(folders["llama"]), eager(folders["tuned"])
    ids = torch.tensor([[2, 3, 4, 5, 2, 6, 7, 8], [2, 3, 4, 5, 2, 6, 7, 8]])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0                                                     # batch row 1: left padding
    inputs = {"input_ids": ids, "attention_mask": mask}
    table = qkv.hf.compare(a, b, inputs)
    with torch.no_grad():
        wa = a(**inputs, output_attentions=True).attentions
        wb = b(**inputs, output_attentions=True).attentions
    want = {}
    for layer in range(2):
        for h in range(4):
            js = [js_bits(wa[layer][n, h, i].numpy(), wb[layer][n, h, i].numpy())
                  for n in range(2) for i in range(8) if mask[n, i]]
            want[(layer, h)] = (np.mean(js), np.max(js))
    assert len(table.rows) == 8
    for r in table.rows:
        assert abs(r.js_mean - want[r.layer, r.head][0]) <= 1e-6 and abs(r.js_max - want[r.layer, r.head][1]) <= 1e-6
    assert [r.layer for r in table.rows[:4]] == [1, 1, 1, 1]             # layer 1's q_proj moved, nothing else
    assert all(r.js_mean == r.js_max == 0.0 for r in table.rows[4:])
    assert [r.js_mean for r in table.rows] == sorted((r.js_mean for r in table.rows), reverse=True)
    assert min(r.js_mean for r in table.rows[:4]) > 1e-3
    text = str(table)
    assert text.splitlines()[0].startswith("layer  head    JS mean     JS max   (Jensen–Shannon divergence, bits")
    top = table.rows[0]
    assert text.splitlines()[1] == f"{top.layer:>5}  {top.head:>4}  {top.js_mean:>9.6f}  {top.js_max:>9.6f}"
    assert table.weights_a[1].shape == (2, 4, 8, 8) and table.query_mask.tolist() == mask.bool().tolist()


def test_identical_checkpoints_are_zero_and_choices_are_kept(folders):
    m = qkv.hf.load(folders["llama"])
    t = qkv.hf.compare(m, eager(folders["llama"]), "the cat sat on the mat", layers=[1], heads=[0, 2])
    enc = m.hf_tokenizer(["the cat sat on the mat"], return_tensors="pt", return_token_type_ids=False)
    assert not isinstance(enc, dict)                                     # a BatchEncoding: taken as it is
    assert qkv.hf.compare(m.model, m.model, enc, layers=[1], heads=[0, 2]).rows == t.rows
    assert [(r.layer, r.head) for r in t.rows] == [(1, 0), (1, 2)]
    assert all(r.js_mean == 0.0 and r.js_max == 0.0 for r in t.rows)
    np.testing.assert_array_equal(t.weights_a[1], t.weights_b[1])


def test_js_divergence_bounds():
    from qkv.hf._compare import js_divergence
    p = np.array([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = np.array([[0.0, 0.0, 0.5, 0.5], [0.25, 0.25, 0.25, 0.25]])
    assert js_divergence(p, q).tolist() == [1.0, 0.0]                  # disjoint: 1 bit; the same row: 0
    assert js_divergence([0.9, 0.1], [0.1, 0.9]) == pytest.approx(js_bits(np.array([0.9, 0.1]),
                                                                           np.array([0.1, 0.9])), abs=1e-15)


def test_compare_refuses_another_architecture_naming_b(folders):
    a = qkv.hf.load(folders["llama"])
    with pytest.raises(ValueError, match=r"^b: expected a checkpoint of a's architecture \(num_hidden_layers=2\), "
                                         r"got num_hidden_layers=3$"):
        qkv.hf.compare(a, qkv.hf.load(folders["deeper"]), "the cat")
    with pytest.raises(ValueError, match=r"^b: expected .*model_type=llama.* got model_type=qwen2"):
        qkv.hf.compare(a, qkv.hf.load(folders["qwen2"]), "the cat")
    with pytest.raises(TypeError, match=r"^b: expected a transformers PreTrainedModel or a qkv.hf.Model, got str"):
        qkv.hf.compare(a, "tiny", "the cat")
    with pytest.raises(TypeError, match=r"^inputs: a str needs a to be a qkv.hf.Model"):
        qkv.hf.compare(a.model, a.model, "the cat")
    with pytest.raises(TypeError, match=r"^inputs: expected a dict of tensors"):
        qkv.hf.compare(a, a, [1, 2])


def test_compare_data_carries_both_models_weights_and_the_ranked_table(folders):
    a, b = qkv.hf.load(folders["llama"]), qkv.hf.load(folders["tuned"])
    text = "the cat sat on the mat"
    d = viz.compare_data(a, b, text)
    t = qkv.hf.compare(a, b, text)
    assert d["table"] == [[r.layer, r.head, r.js_mean, r.js_max] for r in t.rows]
    assert d["tokens"] == ["the", "cat", "sat", "on", "the", "mat"] and d["unit"] == "bits"
    maps, n = decode_maps(d["maps"]), len(d["pairs"])
    assert n == 8 and len(maps) == 16
    for k, (layer, head) in enumerate(d["pairs"]):
        np.testing.assert_array_equal(maps[k], np.tril(quantize(t.weights_a[layer][0, head])))
        np.testing.assert_array_equal(maps[n + k], np.tril(quantize(t.weights_b[layer][0, head])))
    page = viz.render_page({"compare": d, "first": "compare"}, lang="zh")
    assert "<title>tiny-llama 对比 tiny-llama-tuned · the cat sat on the mat</title>" in page


def test_a_comparison_over_the_pages_limit_is_refused_before_running_the_models(folders, monkeypatch):
    from qkv.viz import page
    a = qkv.hf.load(folders["llama"])
    monkeypatch.setattr(page, "MAX_CELLS", 50)
    monkeypatch.setattr(qkv.hf, "compare", lambda *x, **k: pytest.fail("the models ran"))
    with pytest.raises(viz.PageTooLarge, match=r"^two models' attention over 6 tokens: 16 maps of 6 × 6 tokens are "
                                               r"336 weights; the page holds at most 50"):
        viz.compare_data(a, a, "the cat sat on the mat")
    with pytest.raises(viz.PageTooLarge, match=r"4 maps of 6 × 6 tokens are 84 weights"):     # layer 1, 2 heads
        viz.compare_data(a, a, "the cat sat on the mat", layers=[1], heads=[0, 2])


def test_an_encoders_comparison_keeps_every_key(folders):
    """BERT: bidirectional maps (nothing above the diagonal is dropped), every row real, identical models 0."""
    bert = qkv.hf.load(folders["bert"])
    d = viz.compare_data(bert, bert, "the cat sat on the mat")
    t = qkv.hf.compare(bert, bert, "the cat sat on the mat")
    assert d["causal"] is False and all(row[2] == row[3] == 0.0 for row in d["table"])
    maps = decode_maps(d["maps"])
    layer, head = d["pairs"][5]
    np.testing.assert_array_equal(maps[5], quantize(t.weights_a[layer][0, head]))
    assert np.triu(maps[5], 1).any()                                     # keys after the query are kept


# ------------------------------------------------------------------------------------------ titles
def test_the_title_names_the_model_and_the_input_in_both_languages(folders):
    from qkv.explain import examples as ex
    m = qkv.hf.load(folders["llama"])
    md = viz.model_data("the cat sat", model=m)
    assert md["source"] == "qkv.hf" and md["decoder"] is True and md["maps"]["causal"] == [True] * 8
    bert = viz.model_data("the cat sat", model=qkv.hf.load(folders["bert"]))
    assert bert["decoder"] is False and bert["source"] == "qkv.hf"
    pg = viz.from_worked(ex.load_example("seed003"))
    for lang in ("en", "zh"):
        page = viz.render_page({"playground": pg, "model": md, "first": "model"}, lang=lang)
        assert "<title>tiny-llama · the cat sat</title>" in page
        assert embedded(page)["first"] == "model"
    long = " ".join(["the cat sat on the mat"] * 20)
    md = viz.model_data(long, model=m)
    title = re.search(r"<title>(.*?)</title>", viz.render_page({"model": md, "first": "model"}))[1]
    assert title == "tiny-llama · " + long[:59] + "…"
    with pytest.raises(ValueError, match=r"^first: expected None or the view the page opens on, one of model "):
        viz.render_page({"model": md, "first": "generation"})
    plain = viz.render_page({"playground": pg, "model": md})             # no first: the playground's title
    assert "<title>Seed 003 · 我 爱 吃" in plain


# ------------------------------------------------------------------------------------------ CLI
def test_view_hf_generate_and_compare_write_pages_that_open_on_them(folders, tmp_path, capsys):
    from cli_checks import run
    page = tmp_path / "g.html"
    code, out, err = run(capsys, "view", "--hf", folders["gemma2"], "--generate", "the cat sat", "-n", "4",
                         "-o", page)
    assert code == 0, err
    d = embedded(page.read_text(encoding="utf-8"))
    assert d["first"] == "generation" and d["generation"]["name"] == "tiny-gemma2"
    assert d["playground"] is None and d["why"] is None                  # as with SmolLM2: --example adds them
    ref = viz.hf_generation_data(qkv.hf.load(folders["gemma2"]), "the cat sat", max_new_tokens=4)
    assert d["generation"]["steps"] == ref["steps"] and d["generation"]["tokens"] == ref["tokens"]
    code, out, err = run(capsys, "view", "--hf", folders["chat"], "--generate", "the cat", "--chat", "-n", "2",
                         "-T", "0.7", "--seed", "3", "-o", page)
    assert code == 0, err
    assert embedded(page.read_text(encoding="utf-8"))["generation"]["tokens"][:4] == ["the", "cat", "and", "it"]
    code, out, err = run(capsys, "view", "--hf", folders["llama"], "--compare", folders["tuned"], "--text",
                         "the cat sat", "-o", page, "--lang", "zh")
    assert code == 0, err
    text = page.read_text(encoding="utf-8")
    d = embedded(text)
    assert d["first"] == "compare" and d["compare"]["name_b"] == "tiny-llama-tuned"
    assert "<title>tiny-llama 对比 tiny-llama-tuned · the cat sat</title>" in text


@pytest.mark.parametrize("args, pattern", [
    (["--compare", "{llama}", "--text", "the cat"], r"--compare DIR: compares two model folders; give the first "
                                                    r"with --hf DIR"),
    (["--hf", "{llama}", "--compare", "{qwen2}", "--text", "the cat"],
     r"--compare: expected a checkpoint of --hf's architecture \(model_type=llama"),
    (["--hf", "{llama}", "--compare", "{deeper}", "--text", "the cat"],
     r"--compare: expected .*\(num_hidden_layers=2\), got num_hidden_layers=3$"),
    (["--hf", "{llama}", "--compare", "{llama}/missing", "--text", "the cat"], r"^qkv: error: --compare: no folder"),
    (["--hf", "{llama}", "--compare", "{tuned}"], r"--compare DIR: give the text with --text TEXT"),
    (["--hf", "{llama}", "--compare", "{tuned}", "--generate", "the"], r"give either --generate PROMPT or --compare"),
    (["--hf", "{bert}", "--generate", "the cat"], r"--generate: needs a causal language model; tiny-bert is an "
                                                  r"encoder \(bert\): it does not generate$"),
    (["--hf", "{llama}", "--generate", "the cat", "-n", "0"], r"-n/--max-new-tokens: expected an integer >= 1, "
                                                              r"got 0$"),
    (["--hf", "{llama}", "--generate", "the cat", "-n", "255"], r"-n/--max-new-tokens: expected 1 … 254 \(the "
                                                                r"context holds 256 tokens, the prompt takes 2\), "
                                                                r"got 255$"),
    (["--hf", "{llama}", "--generate", "the cat", "-T", "-1"], r"-T/--temperature: expected 0"),
    (["--hf", "{llama}", "--generate", "the cat", "--chat"], r"--chat: tiny-llama has no chat template"),
    (["--hf", "{llama}", "--generate", "the cat", "--text", "the"], r"give either --text TEXT or --generate"),
    (["--hf", "{llama}"], r"--hf DIR: give the text with --text TEXT \(or --generate PROMPT for a decoder\)"),
])
def test_bad_generate_and_compare_options_are_one_line(folders, tmp_path, capsys, args, pattern):
    from cli_checks import one_line, run
    page = tmp_path / "v.html"
    args = [a.format(**{k: os.fspath(v) for k, v in folders.items()}) for a in args]
    code, _, err = run(capsys, "view", *args, "-o", page)
    one_line(code, err, pattern)
    assert not page.exists()
