"""The ``qkv`` command. Its dependencies (click, rich, PyYAML, tqdm) come with the ``cli`` extra.

Errors a user can cause end as one line on stderr and exit code 2, never a traceback: a bad argument or file, a
missing optional dependency (the line names the extra to install), an input nested too deeply to read, or
running out of memory.
"""
from __future__ import annotations

import sys


class UserError(Exception):
    """A problem with what the user asked for; printed as one line, exit code 2."""


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


#: The optional dependencies and the extra that brings each (pyproject.toml).
EXTRAS = {"click": "cli", "rich": "cli", "yaml": "cli", "tqdm": "cli", "matplotlib": "viz", "networkx": "viz",
          "safetensors": "model", "tokenizers": "model", "gguf": "llama", "jinja2": "llama", "threadpoolctl": "fast",
          "torch": "torch"}


def _command(argv) -> str:
    args = sys.argv[1:] if argv is None else list(argv)
    words = [a for a in args if not a.startswith("-")]
    return f"qkv {words[0]}" if words else "qkv"


def import_message(exc: ImportError, argv=None) -> str:
    """One line for a missing dependency: the library's own install hint when it gives one, else the module and
    the extra that brings it."""
    msg = _one_line(exc)
    if "pip install" in msg:
        return f"error: {msg}"
    name = (getattr(exc, "name", None) or "").split(".")[0]
    extra = EXTRAS.get(name)
    if extra:
        return f"{_command(argv)} needs {name} (the {extra} extra): pip install 'qkv[{extra}]'"
    return f"error: {msg} (a dependency is missing; pip install 'qkv[dev]' installs every extra)"


def main(argv=None) -> int:
    try:
        import click
    except ImportError:
        print("qkv: the command line needs its extra: pip install 'qkv[cli]'", file=sys.stderr)
        return 2
    try:
        from ._app import cli
    except ImportError as e:                                 # a command module's dependency is missing
        print(f"qkv: {import_message(e, argv)}", file=sys.stderr)
        return 2

    try:
        rv = cli.main(args=argv, prog_name="qkv", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.exceptions.NoArgsIsHelpError as e:           # `qkv`, `qkv lab`: the help, as --help prints it
        print(e.ctx.get_help())
        return 0
    except click.exceptions.Abort:
        print("qkv: aborted", file=sys.stderr)
        return 2
    except click.exceptions.UsageError as e:
        print(f"qkv: {_one_line(e.format_message())} (see qkv {'' if e.ctx is None else e.ctx.command_path.partition(' ')[2] + ' '}--help)".replace("  ", " "), file=sys.stderr)
        return 2
    except click.exceptions.ClickException as e:
        print(f"qkv: {_one_line(e.format_message())}", file=sys.stderr)
        return 2
    except (UserError, ValueError, TypeError, OSError, KeyError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"qkv: error: {_one_line(msg)}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"qkv: {import_message(e, argv)}", file=sys.stderr)
        return 2
    except RecursionError:
        print("qkv: error: the input is nested too deeply to read (lists or mappings inside each other thousands "
              "of levels down)", file=sys.stderr)
        return 2
    except MemoryError:
        print("qkv: error: out of memory (nothing was written); try a smaller input", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qkv: interrupted", file=sys.stderr)
        return 130
    return rv if isinstance(rv, int) else 0


def run() -> None:  # pragma: no cover - console entry point
    sys.exit(main())
