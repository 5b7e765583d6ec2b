"""qkv.hf (issue 28): transformers models on qkv — attn_implementation="qkv" against "eager" on tiny random models
of several architectures (float32, nothing downloaded), the mask as qkv's block structure, qkv.hf.record against
eager's output_attentions, and `qkv model --hf` / `qkv view --hf` on a saved tiny model."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qkv  # noqa: E402
import qkv.hf  # noqa: E402
from qkv.hf._mask import Mask  # noqa: E402

qkv.hf.register()

VOCAB = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _configs():
    from transformers import GptOssConfig, Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config
    return {
        "llama": LlamaConfig(**SMALL),
        "mistral": MistralConfig(**SMALL, sliding_window=5),
        "gemma2": Gemma2Config(**SMALL, head_dim=16, sliding_window=5, attn_logit_softcapping=3.0,
                               query_pre_attn_scalar=24),
        "gptoss": GptOssConfig(**SMALL, head_dim=16, sliding_window=5, num_local_experts=2, num_experts_per_tok=1),
        "qwen2": Qwen2Config(**SMALL),
    }


DECODERS = ("llama", "mistral", "gemma2", "gptoss", "qwen2")


def _decoder(name, seed=0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(_configs()[name], attn_implementation="eager").float().eval()
    with torch.no_grad():
        for mod in m.modules():                           # gpt-oss's sinks start at 0: make them matter
            if hasattr(mod, "sinks") and isinstance(mod.sinks, torch.nn.Parameter):
                mod.sinks.normal_(0.0, 1.0)
    return m


def _bert(seed=0):
    from transformers import AutoModel, BertConfig
    torch.manual_seed(seed)
    c = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                   attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
    return AutoModel.from_config(c, attn_implementation="eager").float().eval()


def _batch(seed=1, T=13, left=True):
    """Two texts of token ids, the first padded (left for a decoder, right for an encoder)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    if left:
        mask[0, :4] = 0
    else:
        mask[0, -4:] = 0
    return ids, mask


def _both(model, fn):
    """``fn(model)`` with eager attention, then with qkv's."""
    model.set_attn_implementation("eager")
    ref = fn(model)
    model.set_attn_implementation("qkv")
    try:
        return ref, fn(model)
    finally:
        model.set_attn_implementation("eager")


# ------------------------------------------------------------------------------------------- registration
def test_register_adds_qkv_to_both_registries():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    assert qkv.hf.register() == "qkv"
    assert AttentionInterface._global_mapping["qkv"].__module__ == "qkv.integrations.hf._attention"   # (public name: qkv.hf._attention)
    assert AttentionMaskInterface._global_mapping["qkv"].__module__ == "qkv.integrations.hf._mask"


def test_import_qkv_does_not_import_transformers():
    code = "import sys, qkv; assert 'transformers' not in sys.modules and 'qkv.hf' not in sys.modules; qkv.hf; " \
           "assert 'qkv.hf' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_transformers_register_is_one_import_error_naming_it():
    code = ("import sys; sys.modules['transformers'] = None\nimport qkv\ntry:\n    qkv.hf.register()\n"
            "except ImportError as e:\n    print(e)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("qkv.hf needs torch and transformers: pip install 'qkv[dev]'"), p.stdout


# ---------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("name", DECODERS)
def test_decoder_logits_and_weights_equal_eager(name):
    model = _decoder(name)
    ids, mask = _batch()
    with torch.no_grad():
        ref, got = _both(model, lambda m: m(input_ids=ids, attention_mask=mask, output_attentions=True))
    real = mask.bool()                                    # a left-padding query attends to nothing: zeros on qkv
    assert (ref.logits - got.logits)[real].abs().max() <= 1e-4
    assert len(got.attentions) == 2 and all(a is not None for a in got.attentions)
    for a, b in zip(ref.attentions, got.attentions):
        rows = real[:, None, :, None].expand_as(a)
        assert (a - b)[rows].abs().max() <= 1e-5


def test_bert_with_padding_equals_eager():
    model = _bert()
    ids, mask = _batch(left=False)
    with torch.no_grad():
        ref, got = _both(model, lambda m: m(input_ids=ids, attention_mask=mask, output_attentions=True))
    real = mask.bool()
    assert (ref.last_hidden_state - got.last_hidden_state)[real].abs().max() <= 1e-4
    for a, b in zip(ref.attentions, got.attentions):
        assert (a - b).abs().max() <= 1e-5                 # every row has a real key: all rows equal
        assert float(b[0, :, :, -4:].abs().max()) == 0.0   # padding keys take no weight


def test_an_encoder_decoder_with_cross_attention_equals_eager():
    """BART: the encoder's padded bidirectional attention, the decoder's causal one, and cross-attention over
    the padded encoder output; logits and greedy generate."""
    from transformers import AutoModelForSeq2SeqLM, BartConfig
    torch.manual_seed(0)
    c = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0,
                   attention_dropout=0.0)
    model = AutoModelForSeq2SeqLM.from_config(c, attn_implementation="eager").eval()
    ids, mask = _batch(left=False)
    dec = torch.randint(2, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, got = _both(model, lambda m: m(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits)
        assert float((ref - got).abs().max()) <= 1e-5
        ref, got = _both(model, lambda m: m.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False))
    assert torch.equal(ref, got)


def test_record_names_an_encoder_decoders_layers():
    """BART repeats layer_idx across its encoder, decoder and cross-attention: the layers are the modules' names;
    the cross-attention's weights are over the encoder's tokens."""
    from transformers import AutoModelForSeq2SeqLM, BartConfig
    torch.manual_seed(0)
    c = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)
    model = AutoModelForSeq2SeqLM.from_config(c, attn_implementation="eager").eval()
    ids, mask = _batch(left=False)
    dec = torch.randint(2, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    cross = "model.decoder.layers.0.encoder_attn"
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, output_attentions=True)
        with qkv.hf.record(model, layers=[cross, "model.encoder.layers.0.self_attn"], heads=[1]) as rec:
            model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    assert rec.layers == ["model.encoder.layers.0.self_attn", cross]
    assert rec.weights[cross].shape == (2, 1, 5, 13)
    assert np.abs(rec.weights[cross] - ref.cross_attentions[0][:, [1]].numpy()).max() <= 1e-6
    assert np.abs(rec.weights[rec.layers[0]] - ref.encoder_attentions[0][:, [1]].numpy()).max() <= 1e-6


def test_the_mask_is_a_block_mask_that_skips_outside_the_window():
    """Mistral's sliding window at 1,024 tokens: qkv's sliding_window mod, most blocks skipped, no dense mask."""
    from transformers.masking_utils import AttentionMaskInterface, sliding_window_causal_mask_function
    fn = AttentionMaskInterface._global_mapping["qkv"]
    m = fn(batch_size=1, q_length=1024, kv_length=1024, mask_function=sliding_window_causal_mask_function(256),
           attention_mask=None)
    assert isinstance(m, Mask) and isinstance(m.block_mask, qkv.BlockMask)
    assert repr(m.mask_mod) == "sliding_window(window=256)"
    assert m.block_mask.sparsity() > 50
    want = (np.arange(1024)[:, None] - np.arange(1024)[None, :])
    assert np.array_equal(m.dense()[0, 0], (want >= 0) & (want < 256))


def test_only_a_plain_causal_mask_is_marked_causal():
    """``Mask.is_causal`` (sdpa's is_causal path) for causal without padding or offsets, nothing else."""
    from transformers.masking_utils import (AttentionMaskInterface, causal_mask_function,
                                            sliding_window_causal_mask_function)
    fn = AttentionMaskInterface._global_mapping["qkv"]
    pad = torch.ones(2, 9, dtype=torch.bool)
    assert fn(batch_size=2, q_length=9, kv_length=9, mask_function=causal_mask_function, attention_mask=pad).is_causal
    pad[0, 0] = False
    cases = [dict(q_length=9, kv_length=9, mask_function=causal_mask_function, attention_mask=pad),
             dict(q_length=1, kv_length=9, q_offset=8, mask_function=causal_mask_function),
             dict(q_length=9, kv_length=9, mask_function=sliding_window_causal_mask_function(4))]
    for kw in cases:
        m = fn(batch_size=2, **kw)
        assert not m.is_causal, kw
        want = np.asarray(transformers.masking_utils.sdpa_mask(batch_size=2, allow_is_causal_skip=False, **kw))
        assert np.array_equal(np.broadcast_to(m.dense(), want.shape), want), kw


def test_an_unknown_torch_mask_function_runs_as_written():
    from transformers.masking_utils import AttentionMaskInterface, chunked_overlay, and_masks, causal_mask_function
    fn = AttentionMaskInterface._global_mapping["qkv"]
    pattern = and_masks(causal_mask_function, chunked_overlay(3, torch.zeros(2, dtype=torch.long)))
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, :2] = False
    m = fn(batch_size=2, q_length=9, kv_length=9, mask_function=pattern, attention_mask=pad)
    from transformers.masking_utils import sdpa_mask
    want = sdpa_mask(batch_size=2, q_length=9, kv_length=9, mask_function=pattern, attention_mask=pad,
                     allow_is_causal_skip=False)
    assert np.array_equal(m.dense(), want.numpy())


@pytest.mark.parametrize("name", ("llama", "mistral", "gemma2", "gptoss"))
def test_generate_continues_as_eager(name):
    """Greedy continuations token for token; 7 + 6 tokens run past the window of 5 (the cache's offsets)."""
    model = _decoder(name)
    ids, mask = _batch(T=7)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref, got = _both(model, lambda m: m.generate(ids, **kw))
    assert torch.equal(ref, got)


@pytest.mark.parametrize("name", ("llama", "mistral", "gemma2"))
def test_generate_with_a_static_cache_continues_as_eager(name):
    """A static cache: generate builds the masks in advance and the model passes them back through the mask
    function, which returns them as they are."""
    model = _decoder(name)
    ids, mask = _batch(T=7)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        ref, got = _both(model, lambda m: m.generate(ids, **kw))
    assert torch.equal(ref, got)


def test_a_4d_tensor_mask_and_no_mask_are_accepted():
    """A caller's own 4-D boolean mask (True = may attend) and None (is_causal) run as sdpa would."""
    from qkv.hf._attention import attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 6, 8, generator=g) for _ in range(3))
    mask = torch.rand(1, 1, 6, 6, generator=g) > 0.3
    mask[..., 0] = True

    class Layer(torch.nn.Module):
        is_causal = True
    with torch.no_grad():
        out, _ = attention(Layer(), q, k, v, mask)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert (out - ref.transpose(1, 2)).abs().max() <= 1e-5
        out, _ = attention(Layer(), q, k, v, None)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert (out - ref.transpose(1, 2)).abs().max() <= 1e-5
        heads_mask = torch.rand(1, 4, 6, 6, generator=g) > 0.3                # one mask per head
        heads_mask[..., 0] = True
        out, w = attention(Layer(), q, k, v, heads_mask, output_attentions=True)
        scores = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~heads_mask, float("-inf"))
        assert (w - scores.softmax(-1)).abs().max() <= 1e-6
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=heads_mask)
        assert (out - ref.transpose(1, 2)).abs().max() <= 1e-5
        with pytest.raises(TypeError, match="attention_mask: expected a qkv.hf mask"):
            attention(Layer(), q, k, v, "causal")


# --------------------------------------------------------------------------------------------- backward
def _grads(model, fn):
    model.zero_grad()
    fn(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ("llama", "mistral", "gemma2", "gptoss", "bert"))
def test_every_gradient_equals_eager(name):
    pytest.importorskip("qkv.torch")
    model = _bert() if name == "bert" else _decoder(name)
    ids, mask = _batch(left=name != "bert")
    real = mask.bool()

    def loss(m):                                          # a fixed projection (a LayerNorm's Σy² is constant)
        out = m(input_ids=ids, attention_mask=mask)
        y = out.last_hidden_state if name == "bert" else out.logits
        proj = torch.randn(y.shape[-1], generator=torch.Generator().manual_seed(5))
        return ((y[real] @ proj) ** 2).mean()
    ref, got = _both(model, lambda m: _grads(m, loss))
    assert ref.keys() == got.keys() and len(ref) > 5
    # a gradient that is 0 in exact arithmetic (BERT's key bias: a softmax ignores what a row adds to every score)
    # is rounding noise: it is held to the model's gradient scale instead of its own
    floor = 1e-6 * max(float(g.abs().max()) for g in ref.values())
    for n in ref:
        scale = max(float(ref[n].abs().max()), floor)
        assert float((ref[n] - got[n]).abs().max()) <= 1e-4 * scale, n


def test_attention_dropout_in_training_is_seeded_by_torch():
    """BERT's attention dropout (p = 0.3) in train mode: qkv.torch's dropout, reproduced by torch.manual_seed,
    different for another seed, absent in eval mode; the gradients are finite."""
    pytest.importorskip("qkv.torch")
    from transformers import AutoModel, BertConfig
    torch.manual_seed(0)
    c = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96,
                   attention_probs_dropout_prob=0.3, hidden_dropout_prob=0.0)
    model = AutoModel.from_config(c, attn_implementation="qkv").float().train()
    ids, mask = _batch(left=False)

    def run(seed):
        torch.manual_seed(seed)
        model.zero_grad()
        y = model(input_ids=ids, attention_mask=mask).last_hidden_state
        y.sum().backward()
        return y.detach(), model.embeddings.word_embeddings.weight.grad.clone()
    (a, ga), (b, gb), (c2, _) = run(1), run(1), run(2)
    assert torch.equal(a, b) and torch.equal(ga, gb) and bool(torch.isfinite(ga).all())
    assert float((a - c2).abs().max()) > 1e-3
    model.eval()
    with torch.no_grad():
        ref, got = _both(model, lambda m: m(input_ids=ids, attention_mask=mask).last_hidden_state)
    assert float((ref - got)[mask.bool()].abs().max()) <= 1e-4


def test_what_qkv_cannot_do_is_an_error_not_a_silent_difference():
    from qkv.hf._attention import attention

    class Layer(torch.nn.Module):
        is_causal = False
        training = True
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"dropout: attention dropout \(0.1\) with softcap or sinks"):
        attention(Layer(), q, q, q, None, dropout=0.1, softcap=5.0)
    with pytest.raises(ValueError, match="position_bias"):
        attention(Layer(), q, q, q, None, position_bias=torch.zeros(1, 2, 4, 4))


# ---------------------------------------------------------------------------------------------- record
def _o_proj_inputs(model):
    """Each layer's attention output before o_proj (B, L, H·Ev), from forward hooks."""
    got = {}
    hooks = [mod.register_forward_hook(lambda mod, args, out, i=i: got.__setitem__(i, args[0].detach()))
             for i, mod in enumerate(layer.self_attn.o_proj for layer in model.model.layers)]
    return got, hooks


@pytest.mark.parametrize("name", ("gemma2", "gptoss", "llama"))
def test_record_keeps_eagers_weights_for_chosen_heads_and_rows(name):
    model = _decoder(name)
    ids, mask = _batch()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        inputs, hooks = _o_proj_inputs(model)
        model(input_ids=ids, attention_mask=mask)
        for h in hooks:
            h.remove()
        with qkv.hf.record(model, layers=[1], heads=[3, 1], rows=[5, -1]) as rec:
            model(input_ids=ids, attention_mask=mask)
    assert model.config._attn_implementation == "eager"                  # switched back after the block
    assert rec.layers == [1] and rec.trace_head == 3
    w = rec.weights[1]
    assert w.shape == (2, 2, 2, 13) and w.dtype == np.float32
    want = ref.attentions[1][:, [3, 1]][:, :, [5, 12]].numpy()
    assert np.abs(w - want).max() <= 1e-6
    t = rec.traces[1]
    assert t.names()[:3] == ["Q", "K", "V"] and "weights" in t and "output" in t
    assert np.abs(t["weights"].array[:, 0] - want[:, 0]).max() <= 1e-6
    Ev = t["output"].array.shape[-1]
    head_out = inputs[1].reshape(2, 13, 4, Ev)[:, [5, 12], 3].numpy()        # (B, R, Ev), head 3
    assert np.abs(t["output"].array[:, 0] - head_out).max() <= 1e-5
    if name == "gemma2":
        assert "capped" in t


def test_record_of_bert_with_padding_equals_eagers_weights():
    model = _bert()
    ids, mask = _batch(left=False)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        with qkv.hf.record(model, heads=2, rows=[0, 9]) as rec:
            model(input_ids=ids, attention_mask=mask)
    assert rec.layers == [0, 1]
    for layer in rec.layers:
        want = ref.attentions[layer][:, [2]][:, :, [0, 9]].numpy()
        assert np.abs(rec.weights[layer] - want).max() <= 1e-6
        assert float(np.abs(rec.traces[layer]["weights"].array[0, 0, :, -4:]).max()) == 0.0   # padding keys


def test_record_of_every_layer_feeds_the_pictures_and_the_explainer():
    model = _decoder("llama")
    ids = torch.randint(2, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), qkv.hf.record(model) as rec:
        model(input_ids=ids)
    assert rec.layers == [0, 1] and rec.weights[0].shape == (1, 4, 9, 9)
    kinds = qkv.viz.head_kinds(rec.attentions)
    assert kinds.kind.shape == (2, 4)
    R = qkv.viz.rollout(rec.attentions)
    assert np.allclose(R.sum(-1), 1.0)
    text = qkv.explain.explain_query(rec.traces[1], 4, head=0)
    assert "Query 4" in text
    assert qkv.viz.show(rec.traces[1]).html.startswith("<!DOCTYPE html>")


def test_record_rejects_bad_choices():
    model = _decoder("llama")
    with pytest.raises(TypeError, match="heads: expected None, an int or a non-empty sequence of ints"):
        qkv.hf.record(model, heads="0").__enter__()
    with pytest.raises(ValueError, match=r"rows: expected indices in -3 … 2 \(the call has 3 query rows\), got \[7\]"):
        with torch.no_grad(), qkv.hf.record(model, rows=[7]):
            model(input_ids=torch.tensor([[3, 4, 5]]))
    assert model.config._attn_implementation == "eager"


# --------------------------------------------------------------------------------------------- CLI
WORDS = "[PAD] [UNK] the cat sat on mat and it was tired because animal didn't cross street".split()


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]", pad_token="[PAD]")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama saved as a transformers folder (config.json, model.safetensors, tokenizer.json)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**dict(SMALL, vocab_size=len(WORDS)))).save_pretrained(d)
    _tokenizer().save_pretrained(d)
    return d


def test_qkv_model_hf_prints_the_weights_qkv_computed(folder, capsys):
    from cli_checks import run
    text = "the cat sat on the mat"
    code, out, err = run(capsys, "model", text, "--hf", folder, "--layer", "1", "--token", "mat", "--top", "2")
    assert code == 0, err
    m = qkv.hf.load(folder)
    w = m.run([text]).attentions[1][0, :, 5]                               # (H, T): query 'mat' (#5)
    tokens = m.tokenize(text)
    for h in range(4):
        order = np.argsort(-w[h], kind="stable")[:2]
        want = "  ".join(f"{tokens[j]}#{j} {w[h, j]:.3f}" if tokens.count(tokens[j]) > 1 else
                         f"{tokens[j]} {w[h, j]:.3f}" for j in order)
        assert f"head  {h}: {want}" in out
    code, out, err = run(capsys, "model", text, "--hf", folder, "--layer", "1", "--token", "mat", "--head", "2",
                         "--explain")
    assert code == 0 and "Query mat: its whole calculation (head 2)" in out, err
    code, out, err = run(capsys, "model", text, "--hf", folder, "--heads-summary")
    assert code == 0 and f"{os.path.basename(folder)}, 2 layers × 4 heads, 6 tokens" in out, err


def test_qkv_view_hf_writes_the_model_view(folder, tmp_path, capsys):
    from cli_checks import run
    page = tmp_path / "v.html"
    code, out, err = run(capsys, "view", "--hf", folder, "--text", "the cat sat on the mat", "-o", page)
    assert code == 0, err
    text = page.read_text(encoding="utf-8")
    import re
    data = json.loads(re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', text, re.S).group(1))
    assert data["model"]["tokens"] == ["the", "cat", "sat", "on", "the", "mat"]
    assert data["model"]["name"] == os.path.basename(folder)


def _copy(src, dest, *names) -> bool:
    """Copy ``names`` (or every file: "*") of the good folder ``src`` into ``dest``."""
    import shutil
    for f in (os.listdir(src) if names == ("*",) else names):
        shutil.copy(src / f, dest / f)
    return True


@pytest.mark.parametrize("make, pattern", [
    (lambda d, s: d / "missing", r"--hf: no folder '.*missing'$"),
    (lambda d, s: (d / "f.txt").write_text("x") and d / "f.txt", r"is a file, expected a model folder"),
    (lambda d, s: d, r"is not a transformers model folder \(it has no config.json\)$"),
    (lambda d, s: (d / "config.json").write_text("{}") and d, r"has no .safetensors weights"),
    (lambda d, s: _copy(s, d, "config.json", "model.safetensors") and d, r"has no tokenizer qkv can load \("),
    (lambda d, s: _copy(s, d, "*") and (d / "model.safetensors").write_text("x") and d,
     r"its weights cannot be read \(model.safetensors: its header is not a safetensors header\)$"),
    (lambda d, s: _copy(s, d, "*") and (d / "config.json").write_text("{") and d,
     r"its config.json is not a valid JSON file \("),
])
def test_bad_hf_folders_are_one_line(tmp_path, capsys, make, pattern, folder):
    from cli_checks import one_line, run
    path = make(tmp_path, folder)
    for args in (["model", "the cat", "--hf", path], ["view", "--hf", path, "--text", "the cat", "-o",
                                                      tmp_path / "v.html"]):
        code, out, err = run(capsys, *args)
        one_line(code, err, pattern)
    assert not (tmp_path / "v.html").exists()


def test_hf_and_model_together_are_one_line(folder, tmp_path, capsys):
    from cli_checks import one_line, run
    code, _, err = run(capsys, "model", "the cat", "--hf", folder, "--model", "smollm2")
    one_line(code, err, r"give either --model NAME or --hf DIR, not both")
    code, _, err = run(capsys, "view", "--hf", folder, "-o", tmp_path / "v.html")
    one_line(code, err, r"--hf DIR: give the text with --text TEXT")
