"""The click group. Each command lives in its own module under ``qkv.cli`` and registers on ``cli``."""
from __future__ import annotations

import importlib
import importlib.util

import click

import qkv


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(qkv.__version__, prog_name="qkv")
def cli():
    """qkv — attention built on Q, K, V: explain it, check it, run it fast, see it."""


# One module per group of commands; a module that is not there yet is simply not offered.
COMMAND_MODULES = ("explain_cmd", "bench_cmd", "model_cmd", "viz_cmd", "generate_cmd", "lab_cmd", "ring_cmd")
for _name in COMMAND_MODULES:
    if importlib.util.find_spec(f"qkv.cli.{_name}") is not None:
        importlib.import_module(f"qkv.cli.{_name}")
