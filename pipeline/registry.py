"""Every stage and command of qpipe, declared in one place (lazy, like lm-eval's registry).

An entry names its sub-command (``qpipe <name>``) and Makefile target, its settings type (the
one source of its options, Makefile variables and defaults), its entry function (``run(settings)
-> artifact``; an int is an exit code), and the artifact it writes. The order ``make all``
runs them in is the campaign runner's (pipeline/campaign/runner.py), one for both executors.
Types are named as ``"module:Name"`` and imported only when a command runs, so ``qpipe --help``
stays instant. The CLI is built from this table; the tests check that each entry has a Makefile
target whose variables default to its settings' defaults. Adding a stage: one entry here and its
sub-package (docs/adding-a-stage.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


def load(ref: str) -> Any:
    """The object a ``"module:Name"`` reference names."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Stage:
    """One command: what it takes, what it runs, what it writes."""

    name: str  # qpipe <name>
    settings: str  # "module:Class": a StageSettings subclass
    entry: str  # "module:function": run(settings) -> its artifact (or an exit code)
    help: str
    artifact: str = ""  # "module:Class" of what it writes ("": nothing but output)
    target: str = ""  # its Makefile target when not ``name``

    @property
    def make_target(self) -> str:
        return self.target or self.name

    def settings_type(self) -> Any:
        return load(self.settings)

    def run(self, settings: Any) -> Any:
        return load(self.entry)(settings)


STAGES: tuple[Stage, ...] = (
    Stage("baseline", "pipeline.quantize.baseline:BaselineSettings",
          "pipeline.quantize.baseline:run",
          "resolve the baseline model (convert the embedded one once)",
          "pipeline.quantize.baseline:Baseline"),
    Stage("recipes", "pipeline.quantize.recipes:RecipesSettings", "pipeline.quantize.recipes:run",
          "list the recipes and validate them"),
    Stage("quantize", "pipeline.quantize.settings:QuantizeSettings", "pipeline.quantize.stage:run",
          "quantize the baseline with a recipe (llmcompressor)",
          "pipeline.core.artifacts:Manifest"),
    Stage("sensitivity", "pipeline.search.settings:SensitivitySettings",
          "pipeline.search.stage:run_sensitivity",
          "the damage of quantizing each unit of the baseline alone, per format",
          "pipeline.core.artifacts:SensitivityTable"),
    Stage("search", "pipeline.search.settings:SearchSettings", "pipeline.search.stage:run_search",
          "choose a format per unit under a budget; write recipes/<name>.yaml"),
    Stage("bench", "pipeline.bench.settings:BenchSettings", "pipeline.bench.stage:run",
          "serve variants through vLLM and load-test them",
          "pipeline.core.artifacts:BenchSummary"),
    Stage("eval", "pipeline.eval.settings:EvalSettings", "pipeline.eval.stage:run",
          "score the baseline and variants with lm-eval; percent recovery",
          "pipeline.core.artifacts:RecoverySummary"),
    Stage("gate", "pipeline.eval.settings:GateSettings", "pipeline.eval.gate:run",
          "exit 1 unless each variant's recovery is shown to clear its threshold"),
    Stage("suites", "pipeline.eval.validate:SuitesSettings", "pipeline.eval.validate:run",
          "list and validate the lm-eval task suites in evals/"),
    Stage("campaign", "pipeline.campaign.settings:CampaignSettings",
          "pipeline.campaign.runner:run",
          "every stage for every recipe, then compare (make all)",
          "pipeline.core.artifacts:Comparison", target="all"),
    Stage("compare", "pipeline.report.settings:CompareSettings",
          "pipeline.campaign.compare_recorded:run",
          "join the measured stages into one comparison, report and MLflow parent run",
          "pipeline.core.artifacts:Comparison"),
    Stage("calibrate", "pipeline.calibrate.stage:CalibrateSettings",
          "pipeline.calibrate.stage:run",
          "how often each verdict is wrong: simulated against a known truth"),
    Stage("plan", "pipeline.plan.settings:PlanRequest", "pipeline.plan.cli:run",
          "plan weight and KV-cache memory and concurrency from a config",
          "pipeline.plan.capacity:CapacityPlan"),
    Stage("doctor", "pipeline.serve.doctor:DoctorSettings", "pipeline.serve.doctor:run",
          "this machine's CPU/GPU and vLLM build, and the formats it serves, and why"),
    Stage("ui", "pipeline.report.ui:UiSettings", "pipeline.report.ui:run",
          "start the MLflow UI on 127.0.0.1 and stop it cleanly on Ctrl-C"),
)

BY_NAME: dict[str, Stage] = {stage.name: stage for stage in STAGES}

