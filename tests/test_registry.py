"""The registry is the one list of stages: each entry has a CLI command, a Makefile target that
runs it, settings whose defaults the Makefile does not contradict, and the artifact it says."""

from __future__ import annotations

import json
import re
import subprocess
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from pipeline import registry
from pipeline.cli import build_parser
from pipeline.core.settings import StageSettings, flag_of, flat_fields

MAKEFILE = (Path(__file__).parents[1] / "Makefile").read_text()


def _target_recipe(target: str) -> str:
    """The commands of a Makefile target (its tab-indented lines)."""
    found = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", MAKEFILE, re.M)
    assert found, f"the Makefile has no target {target!r}"
    return found.group(1)


@pytest.mark.parametrize("stage", registry.STAGES, ids=lambda s: s.name)
def test_every_stage_has_a_command_a_target_and_its_types(
        stage: registry.Stage, capsys: pytest.CaptureFixture[str]) -> None:
    settings = stage.settings_type()
    assert issubclass(settings, StageSettings)
    assert callable(registry.load(stage.entry))
    if stage.artifact:
        assert isinstance(registry.load(stage.artifact), type)
    assert re.search(rf"\$\(QPIPE\) {re.escape(stage.name)}\b", _target_recipe(stage.make_target))
    with pytest.raises(SystemExit) as done:
        build_parser(stage.name).parse_args([stage.name, "--help"])
    assert done.value.code == 0 and f"usage: qpipe {stage.name}" in capsys.readouterr().out


def test_every_stage_has_one_entry() -> None:
    assert len(registry.BY_NAME) == len(registry.STAGES)


def _bound_fields(model: type[BaseModel]) -> typing.Iterator[tuple[str, str, Any]]:
    """(Makefile variable, field name, field) of every option of ``model`` bound to one
    (a ``FORCE=1``-style switch as its variable, ``FORCE``)."""
    for name, field in flat_fields(model):
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        make = str(extra.get("make", ""))
        if make.isidentifier() or re.fullmatch(r"[A-Z_]+=1", make):
            yield make.removesuffix("=1"), name, field


def _default_text(value: Any) -> str:
    """A default as a Makefile variable would spell it (a tuple: its items, space-separated)."""
    if isinstance(value, tuple | list):
        return " ".join(map(str, value))
    return str(value)


def test_a_default_lives_in_one_place_the_makefile_passes_only_what_is_set() -> None:
    """Each Makefile variable bound to a stage's settings field defaults to empty (the
    command's own default then applies) or to exactly that default: `make plan` and `qpipe
    plan` plan the same thing."""
    defaults = dict(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*\?=[ \t]*(.*)$", MAKEFILE, re.M))
    checked, drifted = 0, []
    for stage in registry.STAGES:
        for variable, _, field in _bound_fields(stage.settings_type()):
            value = defaults.get(variable, "").strip()
            if variable not in defaults or value.startswith("$("):
                continue  # not a Makefile default, or one derived from another variable
            checked += 1
            if value and value != _default_text(field.default):
                drifted.append(f"{stage.name}: {variable} ?= {value}, the setting's default "
                               f"{field.default!r}")
    assert checked >= 30
    assert not drifted, drifted


def test_the_campaign_composes_the_stages_options_instead_of_copying_them() -> None:
    """What ``make all`` overrides of bench and eval is made from those stages' own fields:
    the same flag, Makefile variable and bounds, unset by default (the campaign file's)."""
    from pipeline.bench.settings import BenchOverrides, BenchSettings
    from pipeline.campaign.settings import CampaignSettings
    from pipeline.core.errors import ConfigError
    from pipeline.core.settings import from_options
    from pipeline.eval.settings import EvalOverrides, EvalSettings

    for overrides, stage in ((BenchOverrides, BenchSettings), (EvalOverrides, EvalSettings)):
        for name, field in overrides.model_fields.items():
            own = stage.model_fields[name]
            assert field.json_schema_extra == own.json_schema_extra, name
            assert all(repr(bound) in repr(field.annotation) for bound in own.metadata), name
            assert field.default in (None, ()), name
    with pytest.raises(ConfigError, match=r"--repeats \(make REPEATS=\)"):
        from_options(CampaignSettings, repeats=0)  # the stage's own bound
    set_here = from_options(CampaignSettings, repeats=2, suites=("standard",))
    assert set_here.file().repeats == 2 and set_here.file().suites == ("standard",)
    assert CampaignSettings().file().suites == ("app",)  # unset: the campaign file's


STUB = """\
#!/usr/bin/env python3
import json, sys
with open(sys.argv[0] + ".calls", "a") as out:
    out.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def _variables(model: type[BaseModel]) -> typing.Iterator[tuple[str, str, str, list[str]]]:
    """(variable, its value, field name, the same value as flag tokens) for each option of
    ``model`` that a Makefile variable sets."""
    for variable, name, field in _bound_fields(model):
        flag = flag_of(name, field)
        inner = field.annotation
        args = [a for a in typing.get_args(inner) if a is not type(None)]
        if typing.get_origin(inner) in (typing.Union, types.UnionType) and len(args) == 1:
            inner = args[0]
        if inner is bool:
            yield variable, "1", name, [flag]
        elif typing.get_origin(inner) is typing.Literal:
            value = str(typing.get_args(inner)[-1])  # the last choice: rarely the default
            yield variable, value, name, [flag, value]
        elif typing.get_origin(inner) in (list, tuple):
            yield variable, "3 5", name, [flag, "3", flag, "5"]
        else:
            yield variable, "3", name, [flag, "3"]


@pytest.mark.parametrize("stage", registry.STAGES, ids=lambda s: s.name)
def test_every_makefile_variable_reaches_its_option(stage: registry.Stage, tmp_path: Path) -> None:
    """`make <target> VAR=value` hands the command that value, exactly as `--flag value` does:
    a variable the Makefile drops (an undefined helper expands to nothing) fails here."""
    variables = list(_variables(stage.settings_type()))
    if not variables:
        pytest.skip(f"qpipe {stage.name} has no Makefile variable")
    stub = tmp_path / "qpipe"
    stub.write_text(STUB)
    stub.chmod(0o755)
    # the environments' stamps taken as current: nothing is installed, only the command run
    current = [f"-o.stamps/{s}" for s in ("pipeline", "ray", "serve-cpu", "serve-cuda")]
    done = subprocess.run(
        ["make", "--no-print-directory", *current, stage.make_target, f"QPIPE={stub}",
         *[f"{variable}={value}" for variable, value, _, _ in variables]],
        cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = [json.loads(line) for line in Path(f"{stub}.calls").read_text().splitlines()]
    assert calls and all(call[0] == stage.name for call in calls), calls
    parser = build_parser(stage.name)
    direct = vars(parser.parse_args([stage.name, *[t for v in variables for t in v[3]]]))
    for call in calls:
        through_make = vars(parser.parse_args(call))
        for variable, value, name, _ in variables:
            assert through_make[name] == direct[name], (
                f"make {stage.make_target} {variable}={value}: qpipe {stage.name} got "
                f"{name}={through_make[name]!r}, not {direct[name]!r}")
