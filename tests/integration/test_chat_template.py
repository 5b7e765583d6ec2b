"""A GGUF file's chat template is the file's program (issue 26): it renders in jinja2's sandbox with limits on
time, memory and output, and every failure is one ValueError naming the file (exit 2 in ``qkv generate``)."""
import time

import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from qkv.models import chat as _chat, load_llama  # noqa: E402
from test_llama import TEMPLATE, write_tiny_llama  # noqa: E402

HOSTILE = {
    "sandbox": ("{{ ''.__class__ }}", r"refused by the sandbox: access to attribute '__class__' of 'str'"),
    "mro": ("{{ messages.__class__.__mro__ }}", r"refused by the sandbox"),
    "syntax": ("{% for m in messages %}{{ m.content ", r"syntax error at line 1: unexpected end of template"),
    "range": ("{% for i in range(10**9) %}x{% endfor %}", r"too large: Range too big.*100000"),
    "nested output": ("{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
                      r"stopped: it rendered more than 1,048,\d+ characters"),
    "nested silent": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      r"stopped: still rendering after 2 s"),
    "string loops": ("{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
                     r"stopped: still rendering after 2 s"),
    "repeat": ("{{ 'x' * 10**9 }}", r"stopped: a sequence of 1 repeated 1000000000 times"),
    "power": ("{{ 2 ** (10**9) }}", r"stopped: a power with exponent 1000000000"),
    "ljust": ("{{ 'a'.ljust(10**9) }}", r"stopped: an argument of 1000000000 \(expected at most 1,048,576"),
    "center": ("{{ 'x'|center(1000000000) }}", r"stopped: an argument of 1000000000"),
    "slice": ("{{ range(10)|slice(1000000000)|list }}", r"stopped: an argument of 1000000000"),
    "format": ("{{ '{:>999999999}'.format(1) }}", r"stopped: a format with a width of 7 digits or more"),
    "percent": ("{{ '%999999999s' % 'x' }}", r"stopped: a format with a width of 7 digits or more"),
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                 "{% endfor %}{{ ns.s|length }}", r"stopped: it took more than 512 MB of memory"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", r"nested too deeply"),
    "raise_exception": ("{{ raise_exception('only user and assistant roles') }}",
                        r"the template raised an error: only user and assistant roles"),
    "undefined": ("{{ foo.bar }}", r"UndefinedError: 'foo' is undefined"),
    "division": ("{{ 1 / 0 }}", r"ZeroDivisionError while rendering: division by zero"),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "templated.gguf"
    write_tiny_llama(path)
    return load_llama(path)


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_every_template_failure_is_one_value_error_naming_the_file(model, kind, monkeypatch):
    source, pattern = HOSTILE[kind]
    model.chat_template, model._template = source, None
    bound = 2 * _chat.MAX_SECONDS + 3
    if "512 MB" in pattern:                  # the memory limit's case: the clock's (2 s) kept out of its way — the
        monkeypatch.setattr(_chat, "MAX_SECONDS", 60.0)    # render takes 1.2 s alone, past 2 s beside a busy worker
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"^templated.gguf: tokenizer.chat_template: " + pattern) as e:
        model.apply_chat_template("hi")
    assert time.perf_counter() - t < bound
    assert "\n" not in str(e.value) and len(str(e.value)) < 300
    with pytest.raises(ValueError, match="templated.gguf: tokenizer.chat_template: "):
        model.generate("hi", max_new_tokens=1, chat=True)


def test_a_refusal_is_not_lost_in_a_garbage_collector_callback(model, monkeypatch):
    """Python code that runs on the thread mid-render — here a gc callback, as hypothesis installs one — is not
    stopped by the limits: the refusal raised inside it was swallowed, tracing went off and the render ended in
    a TypeError ('traceback' object is not callable) or a crash. (The clock's limit is moved out of the way: with a
    collection at every allocation the render is slow, and beside another test worker it reached 2 s before the
    memory limit it is here to trip.)"""
    import gc

    from qkv.models import chat as _chat
    monkeypatch.setattr(_chat, "MAX_SECONDS", 60.0)

    ran = []

    def callback(phase, info):
        for _ in range(600):                               # enough lines that a 256th check lands here
            pass
        ran.append(phase)

    source = HOSTILE["doubling"][0]
    model.chat_template, model._template = source, None
    threshold = gc.get_threshold()
    gc.callbacks.append(callback)
    gc.set_threshold(1)
    try:
        with pytest.raises(ValueError, match="stopped: it took more than 512 MB of memory"):
            model.apply_chat_template("hi")
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(callback)
    assert ran


def test_a_good_template_renders_as_before_and_the_trace_function_is_put_back(model):
    import sys

    model.chat_template, model._template = TEMPLATE, None
    before = sys.gettrace()
    assert model.apply_chat_template("hi there") == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert sys.gettrace() is before
    long = "word " * 100_000                               # a long prompt is not "too much output"
    assert model.apply_chat_template(long).count("word") == 100_000


def test_an_earlier_trace_function_keeps_its_events(model):
    import sys

    seen = []

    def tracer(frame, event, arg):
        seen.append(event)
        return None

    model.chat_template, model._template = TEMPLATE, None
    sys.settrace(tracer)
    try:
        model.apply_chat_template("hi")
    finally:
        sys.settrace(None)
    assert "call" in seen


pytest.importorskip("click")
from qkv.cli import main  # noqa: E402


@pytest.mark.parametrize("kind", ["sandbox", "syntax", "range", "nested output", "nested silent"])
def test_generate_chat_with_a_hostile_template_exits_2_with_one_line(tmp_path, capsys, kind):
    source, pattern = HOSTILE[kind]
    path = tmp_path / "bad-template.gguf"
    write_tiny_llama(path, chat_template=source)
    code = main(["generate", "hi", "--chat", "--gguf", str(path), "-n", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("qkv: error: bad-template.gguf: tokenizer.chat_template: "), err
