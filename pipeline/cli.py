"""The ``qpipe`` command: one sub-command per stage, each calling one stage module.

Every error a user can cause is a :class:`~pipeline.errors.QpipeError`; it is printed as one
paragraph (no traceback) and turned into a non-zero exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pipeline.core import interrupts
from pipeline.core.errors import Interrupted, QpipeError

# sub-command -> module with ``add_arguments(parser)`` and ``run(args) -> int`` (or, with a third
# element X, ``add_X_arguments`` and ``run_X``).
# Modules are imported only when their command runs: torch & co. load in seconds, not at --help.
COMMANDS: dict[str, tuple[str, ...]] = {
    "baseline": ("pipeline.quantize.baseline",
                 "resolve the baseline model (convert the embedded one once)"),
    "recipes": ("pipeline.quantize.recipes", "list the recipes and validate them"),
    "quantize": ("pipeline.quantize.run", "quantize the baseline with a recipe (llmcompressor)"),
    "bench": ("pipeline.bench.run", "serve variants through vLLM and load-test them"),
    "eval": ("pipeline.eval.run", "score the baseline and variants with lm-eval; percent recovery"),
    "gate": ("pipeline.eval.gate",
             "fail if a variant's recovery falls below its recipe's threshold"),
    "suites": ("pipeline.eval.suites", "list and validate the lm-eval task suites in evals/"),
    "campaign": ("pipeline.campaign", "every stage for every recipe, then compare (make all)"),
    "compare": ("pipeline.campaign", "join the measured stages into one comparison, report and "
                "MLflow parent run", "compare"),
    "plan": ("pipeline.plan.cli", "plan weight and KV-cache memory and concurrency from a config"),
    "ui": ("pipeline.core.ui", "start the MLflow UI on 127.0.0.1 and stop it cleanly on Ctrl-C"),
    "doctor": ("pipeline.serve.doctor", "this machine's CPU/GPU and vLLM build, and the formats it "
               "serves, and why"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported to add its arguments."""
    parser = argparse.ArgumentParser(prog="qpipe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text, *variant) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = importlib.import_module(module_name)
            add, run = ("add_arguments", "run") if not variant else (
                f"add_{variant[0]}_arguments", f"run_{variant[0]}")
            getattr(module, add)(sub_parser)
            sub_parser.set_defaults(_run=getattr(module, run))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # SIGTERM takes the same clean-up path as Ctrl-C: temp dirs removed, servers stopped.
    interrupts.install()
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        code = int(args._run(args) or 0)
        interrupts.check()  # an interrupt that a library swallowed still ends as one
        return code
    except KeyboardInterrupt:
        err: QpipeError = Interrupted("interrupted; partial output was removed. Run it again.")
        print(f"qpipe {args.command}: {err}", file=sys.stderr)
        return err.exit_code
    except QpipeError as err:
        print(f"qpipe {args.command}: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
