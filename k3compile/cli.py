"""`k3compile` command line. Each subcommand lives in its own module under k3compile/commands/ and
exposes `register(subparsers)`; the parser sets `func` to run it."""
from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order shown in --help.
COMMANDS = ["info", "build", "generate", "serve", "bench", "report"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3compile", description="Compiler-driven serving stack for Kimi-K3-class models")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"k3compile.commands.{name}").register(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # user-facing errors: one clear line, no traceback unless asked
        from k3compile.errors import UserError
        if isinstance(e, UserError) and not getattr(args, "debug", False):
            print(f"k3compile {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
