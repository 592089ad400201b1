"""`k3compile` command line. Each subcommand lives in its own module under k3compile/commands/ and
exposes `register(subparsers)`; the parser sets `func` to run it."""
from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order shown in --help.
COMMANDS = ["info", "plan", "build", "generate", "serve", "bench", "report", "profile", "train", "train_draft"]


def _no_default(action) -> bool:
    return any(action.default is v for v in (None, False, argparse.SUPPRESS))   # identity: 0 is a default


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help shows each flag's default (unless the help already says it, or there is none)."""

    def _get_help_string(self, action):
        text = action.help
        if "default" in text or _no_default(action) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Every (sub)command's parser shows defaults: subparsers are made with the parent's class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if action.help is None and action.option_strings and not _no_default(action):
            action.help = "(default: %(default)s)"   # a flag without help text still shows its default
        return action


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="k3compile", description="Compiler-driven serving stack for Kimi-K3-class models")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"k3compile.commands.{name}").register(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if isinstance(getattr(args, "device", None), str):
            from k3compile.errors import check_device
            check_device(args.device)
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
