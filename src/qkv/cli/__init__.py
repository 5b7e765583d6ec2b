"""The ``qkv`` command. Its dependencies (click, rich, PyYAML, tqdm) come with the ``cli`` extra.

Errors a user can cause end as one line on stderr and exit code 2, never a traceback: a bad argument or file, a
missing optional dependency (the line names the extra to install), an input nested too deeply to read, or
running out of memory.
"""
from __future__ import annotations

import types

import sys


class UserError(Exception):
    """A problem with what the user asked for; printed as one line, exit code 2."""


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


#: The optional dependencies and the extra that brings each (pyproject.toml).
EXTRAS = types.MappingProxyType(
    {"click": "cli", "rich": "cli", "yaml": "cli", "tqdm": "cli", "matplotlib": "viz", "networkx": "viz",
     "safetensors": "model", "tokenizers": "model", "gguf": "llama", "jinja2": "llama", "threadpoolctl": "fast",
     "torch": "torch"})


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


#: The exit status of a command whose reader went away (a closed pipe: `qkv --help | head -1`), as a shell
#: reports a process that SIGPIPE ended: 128 + 13.
EXIT_PIPE = 141


def main(argv=None) -> int:
    """Run the command line on ``argv`` (None: ``sys.argv``); returns the exit status. A closed pipe ends it
    quietly with :data:`EXIT_PIPE`."""
    try:
        return _main(argv)
    except BrokenPipeError:
        _drop_stdout()
        return EXIT_PIPE


def _drop_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's last flush finds no closed pipe."""
    import os
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(null, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):              # (not a real file: a test's capture)
        pass
    finally:
        os.close(null)


def _main(argv=None) -> int:
    try:
        import click
    except ImportError:
        print("qkv: the command line needs its extra: pip install 'qkv[cli]'", file=sys.stderr)
        return 2
    try:
        from qkv.cli._app import cli
    except ImportError as e:                                 # a command module's dependency is missing
        print(f"qkv: {import_message(e, argv)}", file=sys.stderr)
        return 2

    try:
        rv = cli.main(args=argv, prog_name="qkv", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except SystemExit as e:                                   # click ends a closed pipe so, its streams pacified
        if type(sys.stdout).__name__.endswith("PacifyFlushWrapper"):
            raise BrokenPipeError from e
        raise
    except click.exceptions.NoArgsIsHelpError as e:           # `qkv`, `qkv lab`: the help, as --help prints it
        return _echo(e.ctx.get_help())
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
        if isinstance(e, BrokenPipeError):
            raise
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


def _echo(text: str) -> int:
    """Print ``text``; a full disk or a device that refuses it is one line and exit 2 (a closed pipe: see main)."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        return _unwritable(e)
    return 0


def _unwritable(e: OSError) -> int:
    """Standard output refused what was written (a full disk, /dev/full): one line on stderr, exit status 2."""
    print(f"qkv: error: cannot write to standard output: {e.strerror or e}", file=sys.stderr)
    return 2


def run() -> None:  # pragma: no cover - console entry point
    code = main()
    try:
        sys.stdout.flush()                                    # what is still buffered, before the interpreter does
    except BrokenPipeError:
        _drop_stdout()
        code = EXIT_PIPE
    except OSError as e:
        code = _unwritable(e)
    sys.exit(code)
