"""The ``qpipe`` command: one sub-command per entry of :mod:`pipeline.registry`, a thin face
over the stage's function.

Each sub-command's options are derived from its settings object (the one source of their
defaults and help texts); the Makefile maps its variables onto the same options. Every error a
user can cause is a :class:`~pipeline.core.errors.QpipeError`, printed as one paragraph (no
traceback) and turned into a non-zero exit code.
"""

from __future__ import annotations

import argparse
import sys

from pipeline.core import interrupts
from pipeline.core.errors import Interrupted, QpipeError
from pipeline.core.settings import add_options, from_args
from pipeline.registry import BY_NAME, STAGES

# options that were renamed: refused with the new name, never silently dropped
RENAMED = {"--price-per-hour": "--price-per-device-hour (USD per device-hour, times the "
                               "TP x PP GPUs of the run that measured each capacity)"}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s settings are imported to add its options."""
    parser = argparse.ArgumentParser(
        prog="qpipe", description="quantize, serve, load-test and score LLM variants; compare them")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for stage in STAGES:
        sub_parser = sub.add_parser(stage.name, help=stage.help, description=stage.help)
        if stage.name == command:
            add_options(sub_parser, stage.settings_type())
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # SIGTERM takes the same clean-up path as Ctrl-C: temp dirs removed, servers stopped.
    interrupts.install()
    for given in argv:
        if (old := given.split("=", 1)[0]) in RENAMED:
            print(f"qpipe: {old} is now {RENAMED[old]}", file=sys.stderr)
            return 2
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    stage = BY_NAME[args.command]
    try:
        result = stage.run(from_args(stage.settings_type(), args))
        interrupts.check()  # an interrupt that a library swallowed still ends as one
        return result if isinstance(result, int) and not isinstance(result, bool) else 0
    except KeyboardInterrupt:
        err: QpipeError = Interrupted("interrupted; partial output was removed. Run it again.")
        print(f"qpipe {args.command}: {err}", file=sys.stderr)
        return err.exit_code
    except QpipeError as err:
        print(f"qpipe {args.command}: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
