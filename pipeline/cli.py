"""The ``qpipe`` command: one sub-command per stage, a thin face over the stage's function.

Each sub-command's options are derived from its settings object (the one source of their
defaults and help texts); the Makefile maps its variables onto the same options. Every error a
user can cause is a :class:`~pipeline.core.errors.QpipeError`, printed as one paragraph (no
traceback) and turned into a non-zero exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from pipeline.core import interrupts
from pipeline.core.errors import Interrupted, QpipeError
from pipeline.core.settings import add_options, from_args

# sub-command -> (settings "module:Class", entry "module:function", help). Modules are imported
# only when their command runs: torch & co. load in seconds, not at --help.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "baseline": ("pipeline.quantize.baseline:BaselineSettings", "pipeline.quantize.baseline:run",
                 "resolve the baseline model (convert the embedded one once)"),
    "recipes": ("pipeline.quantize.recipes:RecipesSettings", "pipeline.quantize.recipes:run",
                "list the recipes and validate them"),
    "quantize": ("pipeline.quantize.settings:QuantizeSettings", "pipeline.quantize.stage:run",
                 "quantize the baseline with a recipe (llmcompressor)"),
    "sensitivity": ("pipeline.search.settings:SensitivitySettings",
                    "pipeline.search.stage:run_sensitivity",
                    "the damage of quantizing each unit of the baseline alone, per format"),
    "search": ("pipeline.search.settings:SearchSettings", "pipeline.search.stage:run_search",
               "choose a format per unit under a budget; write recipes/<name>.yaml"),
    "bench": ("pipeline.bench.settings:BenchSettings", "pipeline.bench.stage:run",
              "serve variants through vLLM and load-test them"),
    "eval": ("pipeline.eval.settings:EvalSettings", "pipeline.eval.stage:run",
             "score the baseline and variants with lm-eval; percent recovery"),
    "gate": ("pipeline.eval.settings:GateSettings", "pipeline.eval.gate:run",
             "exit 1 unless each variant's recovery is shown to clear its threshold"),
    "suites": ("pipeline.eval.validate:SuitesSettings", "pipeline.eval.validate:run",
               "list and validate the lm-eval task suites in evals/"),
    "campaign": ("pipeline.campaign:CampaignSettings", "pipeline.campaign:run",
                 "every stage for every recipe, then compare (make all)"),
    "compare": ("pipeline.report.settings:CompareSettings", "pipeline.report.stage:run",
                "join the measured stages into one comparison, report and MLflow parent run"),
    "calibrate": ("pipeline.calibrate.stage:CalibrateSettings", "pipeline.calibrate.stage:run",
                  "how often each verdict is wrong: simulated against a known truth"),
    "plan": ("pipeline.plan.settings:PlanRequest", "pipeline.plan.cli:run",
             "plan weight and KV-cache memory and concurrency from a config"),
    "doctor": ("pipeline.serve.doctor:DoctorSettings", "pipeline.serve.doctor:run",
               "this machine's CPU/GPU and vLLM build, and the formats it serves, and why"),
    "ui": ("pipeline.core.ui:UiSettings", "pipeline.core.ui:run",
           "start the MLflow UI on 127.0.0.1 and stop it cleanly on Ctrl-C"),
}


def _load(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s settings are imported to add its options."""
    parser = argparse.ArgumentParser(
        prog="qpipe", description="quantize, serve, load-test and score LLM variants; compare them")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (settings_ref, _, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            add_options(sub_parser, _load(settings_ref))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # SIGTERM takes the same clean-up path as Ctrl-C: temp dirs removed, servers stopped.
    interrupts.install()
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    settings_ref, entry_ref, _ = COMMANDS[args.command]
    try:
        result = _load(entry_ref)(from_args(_load(settings_ref), args))
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
