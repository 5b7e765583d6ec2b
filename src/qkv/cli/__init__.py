"""The ``qkv`` command. Its dependencies (click, rich, PyYAML, tqdm) come with the ``cli`` extra.

Errors a user can cause end as one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import sys


class UserError(Exception):
    """A problem with what the user asked for; printed as one line, exit code 2."""


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


def main(argv=None) -> int:
    try:
        import click
    except ImportError:
        print("qkv: the command line needs its extra: pip install 'qkv[cli]'", file=sys.stderr)
        return 2
    from ._app import cli

    try:
        rv = cli.main(args=argv, prog_name="qkv", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
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
    except KeyboardInterrupt:
        print("qkv: interrupted", file=sys.stderr)
        return 130
    return rv if isinstance(rv, int) else 0


def run() -> None:  # pragma: no cover - console entry point
    sys.exit(main())
