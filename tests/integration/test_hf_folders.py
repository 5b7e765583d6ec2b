"""A model folder is data, never trusted (issue 40, item 2): config.json's counts are positive integers within
bounds and match the weights' headers, checked before torch or transformers builds anything; pickles refused.
Each case is one line, exit 2, within seconds — for ``qkv model --hf`` and ``qkv view --hf`` alike."""
import json
import shutil
import time

import pytest

from cli_checks import one_line, run

pytest.importorskip("transformers")
pytestmark = pytest.mark.model

from test_hf import folder  # noqa: E402,F401  (the fixture: a tiny random Llama, 2 layers, 4 heads of 16, width 64)


@pytest.fixture
def good(request):
    """test_hf's tiny Llama folder (made once a module), here under its own name."""
    return request.getfixturevalue("folder")


def _with(good, tmp_path, **changes):
    d = tmp_path / "m"
    shutil.copytree(good, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("changes, pattern", [
    ({"num_hidden_layers": 1_000_000_000}, r"num_hidden_layers: expected a positive integer of at most 16,777,216"),
    ({"num_hidden_layers": 100_000}, r"config.json: num_hidden_layers is 100,000, but the weights hold 2$"),
    ({"num_hidden_layers": 2.5}, r"num_hidden_layers: expected a positive integer .* got 2\.5"),
    ({"num_attention_heads": 0}, r"num_attention_heads: expected a positive integer"),
    ({"num_attention_heads": -4}, r"num_attention_heads: expected a positive integer .* got -4"),
    ({"num_attention_heads": "four"}, r"num_attention_heads: expected a positive integer .* got 'four'"),
    ({"num_attention_heads": 8}, r"num_attention_heads × head_dim is 8 × 16, but the weights' query projection has 64 rows$"),
    ({"hidden_size": 10**12}, r"hidden_size: expected a positive integer of at most"),
    ({"hidden_size": 128}, r"config.json: hidden_size is 128, but the weights hold 64$"),
    ({"vocab_size": 10**10}, r"vocab_size: expected a positive integer of at most"),
    ({"max_position_embeddings": -5}, r"max_position_embeddings: expected a positive integer .* got -5"),
])
def test_a_config_past_its_bounds_or_its_weights_is_one_line(good, tmp_path, capsys, changes, pattern):
    d = _with(good, tmp_path, **changes)
    for args in (["model", "the cat", "--hf", d], ["view", "--hf", d, "--text", "the cat", "-o", tmp_path / "v.html"]):
        t = time.perf_counter()
        code, out, err = run(capsys, *args)
        one_line(code, err, pattern)
        assert time.perf_counter() - t < 10
    assert not (tmp_path / "v.html").exists()


def test_pickled_weights_are_refused_in_one_line(good, tmp_path, capsys):
    d = tmp_path / "p"
    shutil.copytree(good, d)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04pickle that must never be loaded")
    code, out, err = run(capsys, "model", "the cat", "--hf", d)
    one_line(code, err, r"has no .safetensors weights .*pytorch_model.bin is pickled: qkv never loads pickles")


def test_the_good_folder_still_loads(good, capsys):
    code, out, err = run(capsys, "model", "the cat sat", "--hf", good)
    assert code == 0, err


def test_a_pickle_beside_other_safetensors_is_never_loaded(good, tmp_path, capsys):
    """A folder whose model weights are only pickled, with some other .safetensors file beside them: transformers
    would fall back to the pickle; qkv asks for safetensors only — one line, nothing unpickled."""
    import struct
    d = tmp_path / "q"
    shutil.copytree(good, d)
    (d / "model.safetensors").rename(d / "adapter.safetensors")
    header = b"{}"
    (d / "adapter.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04pickle that must never be loaded")
    code, out, err = run(capsys, "model", "the cat", "--hf", d)
    one_line(code, err, r"--hf: .*: transformers cannot load its weights \(")
