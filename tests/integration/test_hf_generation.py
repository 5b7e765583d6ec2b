"""qkv.hf.record around generation (issue 41, parts 1 and 2): ``rec.generation`` against eager's
``generate(…, output_attentions=True, return_dict_in_generate=True)`` on tiny random transformers models (batch of
two, left padding, greedy), qkv's own decoder against a full forward pass of it, ``rec.tokens``, and
``rec.attentions`` in transformers' convention as ``qkv.viz.head_kinds`` / ``rollout`` take it."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import qkv  # noqa: E402
import qkv.hf  # noqa: E402
from test_hf import VOCAB, _batch, _decoder  # noqa: E402

qkv.hf.register()

P, NEW = 7, 6                                             # prompt tokens (4 of the first text are padding), new ones
GEN = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def _gpt2(seed=0):
    from transformers import AutoModelForCausalLM, GPT2Config
    torch.manual_seed(seed)
    c = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0,
                   resid_pdrop=0.0, embd_pdrop=0.0)
    return AutoModelForCausalLM.from_config(c, attn_implementation="eager").float().eval()


def _model(name):
    return _gpt2() if name == "gpt2" else _decoder(name)


def _eager_and_recorded(model, layers, heads):
    """eager's generate with its attentions, then the same generate on qkv inside ``record``."""
    ids, mask = _batch(T=P)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, output_attentions=True, return_dict_in_generate=True, **GEN)
        with qkv.hf.record(model, layers=layers, heads=heads) as rec:
            got = model.generate(ids, attention_mask=mask, **GEN)
    assert torch.equal(ref.sequences, got)
    return ref, rec, mask


# ------------------------------------------------------------------------------------------ transformers
@pytest.mark.parametrize("layers, heads", [(None, None), ([1], [3, 1])])
@pytest.mark.parametrize("name", ("llama", "qwen2", "gemma2", "gpt2", "mistral", "gptoss"))
def test_generation_equals_eagers_attentions_of_every_step(name, layers, heads):
    """Row t of rec.generation[layer] is eager's out.attentions[t][layer][:, :, -1] over that step's keys (Gemma
    2: window + soft-capping; Mistral: a window shorter than the prompt; gpt-oss: sinks), 0 after them, within
    1e-6."""
    model = _model(name)
    ref, rec, mask = _eager_and_recorded(model, layers, heads)
    assert model.config._attn_implementation == "eager" and "generate" not in vars(model)
    assert rec.layers == ([0, 1] if layers is None else layers)
    pick = list(range(4)) if heads is None else heads
    assert rec.tokens.dtype == np.int64 and np.array_equal(rec.tokens, ref.sequences[:, P:].numpy())
    for layer in rec.layers:
        g = rec.generation[layer]
        assert g.shape == (2, len(pick), NEW, P + NEW - 1) and g.dtype == np.float32
        for t, step in enumerate(ref.attentions):
            want = step[layer][:, pick, -1, :].numpy()                     # (B, h, S of step t)
            S = want.shape[-1]
            assert np.abs(g[:, :, t, :S] - want).max() <= 1e-6, (layer, t)
            assert not g[:, :, t, S:].any()
        # the weights keep the first call, the prompt's (real query rows: a padding row is 0 on qkv)
        want = ref.attentions[0][layer][:, pick].numpy()                   # (B, h, P, P)
        real = mask.bool().numpy()
        assert rec.weights[layer].shape == want.shape
        assert np.abs(rec.weights[layer] - want)[real[:, None, :, None].repeat(len(pick), 1).repeat(P, 3)].max() \
            <= 1e-6


@pytest.mark.parametrize("name, window", [("mistral", 5), ("gemma2", 5), ("llama", None)])
def test_by_position_the_rows_are_a_full_forwards_rows(name, window):
    """A windowed layer's cache keeps its last 5 keys: key_offsets says where they start (token P + t − 5 from
    the step whose cache passed 5 keys), and generation_by_position puts row t at its tokens — row P + t − 1 of
    eager's one forward pass over prompt + continuation."""
    model = _model(name)
    ref, rec, mask = _eager_and_recorded(model, None, None)
    seq = ref.sequences
    full_mask = torch.cat([mask, torch.ones(2, NEW, dtype=mask.dtype)], 1)
    with torch.no_grad():
        full = model(input_ids=seq, attention_mask=full_mask, output_attentions=True).attentions
    layer_types = getattr(model.config, "layer_types", None) or ["sliding_attention" if window else "full"] * 2
    for layer in rec.layers:
        cropped = window is not None and layer_types[layer] == "sliding_attention"
        want_offsets = [0] + [max(0, P + t - window) if cropped else 0 for t in range(1, NEW)]
        assert rec.key_offsets[layer].tolist() == want_offsets, layer
        bp = rec.generation_by_position[layer]
        assert bp.shape == (2, 4, NEW, P + NEW - 1)
        for t in range(NEW):
            want = full[layer][:, :, P + t - 1, :P + t].numpy()
            assert np.abs(bp[:, :, t, :P + t] - want).max() <= 2e-6, (layer, t)
    if window is None:
        assert all(np.array_equal(rec.generation[i], rec.generation_by_position[i]) for i in rec.layers)


def test_a_plain_forward_is_one_step_and_rows_choose_the_prompts_rows():
    """model(**inputs) in the block: generation has one row (the last query's) and tokens stay None; rows=[2, -1]
    choose rows of the first call only (a 1-row step of generate does not reject them)."""
    model = _decoder("llama")
    ids, mask = _batch(T=P)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        with qkv.hf.record(model, heads=[2]) as rec:
            model(input_ids=ids, attention_mask=mask)
        assert rec.tokens is None and rec.generation[1].shape == (2, 1, 1, P)
        assert np.abs(rec.generation[1][:, :, 0] - ref[1][:, [2], -1].numpy()).max() <= 1e-6
        with qkv.hf.record(model, layers=[0], rows=[2, -1]) as rec:
            out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **GEN)
    assert rec.weights[0].shape == (2, 4, 2, P) and rec.rows_of[0].tolist() == [2, P - 1]
    assert rec.generation[0].shape == (2, 4, NEW, P + NEW - 1)
    assert np.array_equal(rec.tokens, out.sequences[:, P:].numpy())               # from a dict output too
    assert np.abs(rec.generation[0][:, :, 0, :P] - rec.weights[0][:, :, 1]).max() <= 1e-6   # the prompt's last row


def test_generate_is_the_models_own_again_after_the_block():
    """The wrapper is an instance attribute for the block only, removed on an error too; a generate the instance
    had before is back after."""
    model = _decoder("llama")
    ids, _ = _batch(T=P)
    with pytest.raises(RuntimeError, match="stop"), torch.no_grad(), qkv.hf.record(model) as rec:
        assert "generate" in vars(model)
        raise RuntimeError("stop")
    assert "generate" not in vars(model) and model.config._attn_implementation == "eager"
    own = model.generate

    def counted(*args, **kwargs):
        counted.calls += 1
        return own(*args, **kwargs)
    counted.calls = 0
    model.generate = counted
    with torch.no_grad(), qkv.hf.record(model, layers=[0]) as rec:
        model.generate(ids[1:], max_new_tokens=3, do_sample=False)
    assert counted.calls == 1 and vars(model)["generate"] is counted and rec.tokens.shape == (1, 3)


def test_two_batches_in_one_block_are_an_error_naming_generation():
    model = _decoder("llama")
    with torch.no_grad(), qkv.hf.record(model, layers=[0]) as rec:
        model(input_ids=torch.tensor([[3, 4, 5]]))
        model(input_ids=torch.tensor([[3, 4, 5], [6, 7, 8]]))
    with pytest.raises(ValueError, match=r"generation: the calls of one layer had \(batch, heads\) \[\(1, 4\), "
                                         r"\(2, 4\)\]; record one generate or one batch per block"):
        rec.generation
    with pytest.raises(TypeError, match="model: expected a transformers PreTrainedModel .*, got object"):
        qkv.hf.record(object()).__enter__()


# ------------------------------------------------------------------------------------------ rec.attentions
def test_attentions_are_transformers_outputs_attentions():
    """A tuple over the recorded layers of (B, heads, rows, S), eager's output_attentions on the real rows;
    head_kinds and rollout take it as it is (batch row 0) — the same as given row 0 alone, or eager's tuple."""
    model = _decoder("llama")
    ids, mask = _batch(T=9)
    mask[0, :4] = 1                                                     # no padding: every row comparable
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        with qkv.hf.record(model) as rec:
            model(input_ids=ids, attention_mask=mask)
    att = rec.attentions
    assert isinstance(att, tuple) and len(att) == 2 and att[0].shape == (2, 4, 9, 9)
    assert max(float(np.abs(a - r.numpy()).max()) for a, r in zip(att, ref)) <= 1e-6
    row0 = [a[0] for a in att]
    for given in (att, ref, list(att), np.stack(att)):
        kinds = qkv.viz.head_kinds(given)
        want = qkv.viz.head_kinds(row0)
        assert np.array_equal(kinds.kind, want.kind)
        assert all(np.allclose(kinds.scores[k], want.scores[k], atol=1e-6) for k in want.scores)
        np.testing.assert_allclose(qkv.viz.rollout(given), qkv.viz.rollout(row0), atol=1e-6)
    second = qkv.viz.head_kinds([a[1] for a in att])                    # row 1 differs: row 0 was read
    assert not all(np.allclose(second.scores[k], want.scores[k]) for k in want.scores)


# ------------------------------------------------------------------------------------------ qkv's decoder
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("gguf")
    from test_llama import write_tiny_llama

    from qkv.models import load_llama
    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf"
    write_tiny_llama(path)
    return load_llama(path)


@pytest.mark.parametrize("layers, heads", [(None, None), ([1, 0], [3, 0])])
def test_qkv_decoder_generation_equals_its_full_forward(tiny_llama, layers, heads):
    """qkv's LlamaModel.generate recorded through the same class: generation row t is row P + t − 1 of one traced
    forward pass over prompt + continuation (qkv.viz.decoder_attentions), the weights the prompt's; tokens the
    ids generate returned."""
    from qkv.viz.page import decoder_attentions
    model = tiny_llama
    with qkv.hf.record(model, layers=layers, heads=heads) as rec:
        g = model.generate("hello the world", max_new_tokens=NEW)
    assert "attention_observer" not in vars(model) and "generate" not in vars(model)
    assert isinstance(rec, qkv.hf.Recording) and rec.layers == [0, 1]
    assert np.array_equal(rec.tokens, [g.ids]) and rec.tokens.dtype == np.int64
    n, pick = len(g.prompt_ids), [0, 1, 2, 3] if heads is None else heads
    full = list(decoder_attentions(model, g.prompt_ids + g.ids))             # per layer (H, T, T)
    prompt = list(decoder_attentions(model, g.prompt_ids))
    for layer in rec.layers:
        gen = rec.generation[layer]
        assert gen.shape == (1, len(pick), len(g.ids), n + len(g.ids) - 1)
        for t in range(len(g.ids)):
            want = full[layer][pick, n + t - 1, :n + t]
            assert np.abs(gen[0, :, t, :n + t] - want).max() <= 2e-6, (layer, t)
            assert not gen[0, :, t, n + t:].any()
        assert np.abs(rec.weights[layer][0] - prompt[layer][pick]).max() <= 2e-6
    assert rec.traces[1].names()[:3] == ["Q", "K", "V"]


def test_qkv_decoder_forward_with_padding_is_one_recorded_step(tiny_llama):
    """LlamaModel.forward on a right-padded batch inside record: the weights are run()'s (padding keys masked,
    causal), the generation row each text's last position."""
    model = tiny_llama
    out = model.run(["hello the world", "the"])
    with qkv.hf.record(model, heads=[1, 2]) as rec:
        model.forward(out.input_ids, out.attention_mask)
    T = out.input_ids.shape[1]
    assert rec.tokens is None
    for layer in rec.layers:
        want = out.attentions[layer][:, [1, 2]]                             # (B, 2, T, T)
        assert rec.weights[layer].shape == (2, 2, T, T)
        assert np.abs(rec.weights[layer] - want).max() <= 2e-6
        assert np.abs(rec.generation[layer][:, :, 0] - want[:, :, T - 1]).max() <= 2e-6
