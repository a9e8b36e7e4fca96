"""Settings objects are the one source of each default: CLI options, YAML checks, help texts and
the "re-run it alone" command are derived from them.

A stage's settings are a pydantic model; each field's ``description`` is its help text and
``json_schema_extra`` may give ``flag`` (default ``--field-name``), ``make`` (the Makefile
variable, shown in the help), ``negative`` (a ``--no-...`` flag for a field that defaults to
True) and ``nested`` (a settings model whose fields are offered flat, e.g. the engine's).
"""

from __future__ import annotations

import argparse
import difflib
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.core.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def _extra(field: Any) -> dict[str, Any]:
    extra = field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def flag_of(name: str, field: Any) -> str:
    """The command-line flag of settings field ``name`` (its ``flag``, else ``--name``)."""
    return str(_extra(field).get("flag") or f"--{name.replace('_', '-')}")


def _bare(annotation: Any) -> tuple[Any, bool]:
    """(the type inside Optional[...], whether None is allowed)."""
    if get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else annotation), len(args) < len(get_args(annotation))
    return annotation, False


def _scalar(annotation: Any) -> Any:
    """The argparse ``type`` for a field; a union of types is parsed by the first that fits."""
    inner, _ = _bare(annotation)
    if inner in (int, float, str, Path):
        return inner
    if get_origin(inner) in (typing.Union, types.UnionType):
        kinds = [get_args(a)[0] if get_origin(a) is Annotated else a
                 for a in get_args(inner) if a is not type(None)]

        def parse(text: str) -> Any:
            for kind in kinds:
                if get_origin(kind) is Literal and text in get_args(kind):
                    return text
                if kind in (int, float) and _fits(kind, text):
                    return kind(text)
                if kind is str:
                    return text
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {_shown(kinds)}")
        return parse
    return str


def _fits(kind: type, text: str) -> bool:
    try:
        kind(text)
        return True
    except ValueError:
        return False


def _shown(kinds: list[Any]) -> str:
    return ", ".join(" | ".join(map(repr, get_args(k))) if get_origin(k) is Literal
                     else getattr(k, "__name__", str(k)) for k in kinds)


def flat_fields(model: type[BaseModel], exclude: tuple[str, ...] = ()
                ) -> Iterator[tuple[str, Any]]:
    """(name, field) of every option ``model`` offers: nested settings models flattened."""
    for name, field in model.model_fields.items():
        if name in exclude:
            continue
        if _extra(field).get("nested"):
            yield from flat_fields(_bare(field.annotation)[0], exclude)
        else:
            yield name, field


def add_options(parser: argparse.ArgumentParser, model: type[BaseModel],
                exclude: tuple[str, ...] = ()) -> None:
    """One option per field of ``model`` (nested settings models flattened)."""
    for name, field in flat_fields(model, exclude):
        extra = _extra(field)
        inner, _ = _bare(field.annotation)
        flag = flag_of(name, field)
        help_text = (field.description or "").replace("%", "%%")
        if extra.get("positional"):
            many = get_origin(inner) in (list, tuple)
            parser.add_argument(name, nargs="*" if many else "?", default=None if many
                                else field.default, help=help_text)
            continue
        if extra.get("make"):
            make = str(extra["make"])
            help_text += f" (make: {make if '=' in make else make + '='})"
        default = field.default
        if inner is bool:  # default False: FLAG; True: --no-...; None (auto): both
            if default is not True:
                parser.add_argument(flag, dest=name, action="store_true", default=default,
                                    help=help_text)
            if extra.get("negative"):
                parser.add_argument(extra["negative"], dest=name, action="store_false",
                                    default=default, help=extra.get("negative_help", help_text))
        elif get_origin(inner) in (list, tuple):
            (item,) = get_args(inner)[:1] or (str,)
            parser.add_argument(flag, dest=name, action="append", type=_scalar(item),
                                default=None, metavar=extra.get("metavar"),
                                help=f"{help_text} (repeatable)")
        elif get_origin(inner) is Literal:
            parser.add_argument(flag, dest=name, choices=get_args(inner), default=default,
                                help=f"{help_text} (default: %(default)s)")
        else:
            shown = "" if default is None else " (default: %(default)s)"
            parser.add_argument(flag, dest=name, type=_scalar(field.annotation),
                                default=None if field.is_required() else default,
                                required=field.is_required(), metavar=extra.get("metavar"),
                                help=help_text + shown)


def from_args(model: type[M], args: argparse.Namespace) -> M:
    """The settings an argparse namespace (made by :func:`add_options`) describes."""
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        inner, _ = _bare(field.annotation)
        if _extra(field).get("nested"):
            values[name] = from_args(inner, args)
        elif hasattr(args, name):
            value = getattr(args, name)
            if value is not None or not field.is_required():
                values[name] = value if value is not None else field.get_default(
                    call_default_factory=True)
    try:
        return model.model_validate(values)
    except ValidationError as err:
        raise ConfigError(_explain(err, "the command line", model, options=True)) from None


def from_options(model: type[M], **options: Any) -> M:
    """The settings that options named as on the command line give (nested models flat)."""
    return from_args(model, argparse.Namespace(**options))


def to_argv(settings: BaseModel) -> list[str]:
    """The options that give ``settings`` (defaults left out): a stage's re-run command."""
    out: list[str] = []
    for name, field in type(settings).model_fields.items():
        value = getattr(settings, name)
        extra = _extra(field)
        if extra.get("nested"):
            out += to_argv(value)
            continue
        if extra.get("cli") is False or value == field.get_default(call_default_factory=True):
            continue
        flag = flag_of(name, field)
        if extra.get("positional"):
            out += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
        elif isinstance(value, bool):
            out.append(flag if value else extra["negative"])
        elif isinstance(value, (list, tuple)):
            out += [_option(flag, item) for item in value for _option in [_joined]]
        elif value is not None:
            out.append(_joined(flag, value))
    return out


def _joined(flag: str, value: Any) -> str:
    """``--flag=value``: one word, also when the value itself starts with a dash."""
    return f"{flag}={value}"


def from_yaml(model: type[M], path: Path, overrides: dict[str, Any] | None = None) -> M:
    """A settings file, checked field by field; errors name the file and the field."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: malformed YAML ({getattr(err, 'problem', err)}).") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it ({err.strerror}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a mapping of {', '.join(model.model_fields)} is expected.")
    try:
        return model.model_validate({**data, **(overrides or {})})
    except ValidationError as err:
        raise ConfigError(_explain(err, str(path), model)) from None


def _fields_at(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> list[str]:
    """The user-settable fields of the (nested) model an error's location points into."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if model is not None else None
        inner = _bare(field.annotation)[0] if field is not None else None
        model = inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None
    if model is None:
        return []
    return [name for name, f in model.model_fields.items() if not _extra(f).get("internal")]


def _field_at(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> tuple[str, Any] | None:
    """(name, FieldInfo) of the (nested) field an error's location points at."""
    field = None
    for part in loc:
        field = model.model_fields.get(str(part)) if model is not None else None
        if field is None:
            return None
        inner = _bare(field.annotation)[0]
        model = inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None
    return (str(loc[-1]), field) if field is not None else None


def _option_name(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> str | None:
    """``--repeats (make REPEATS=)``: how a user sets the field on the command line."""
    found = _field_at(model, loc)
    if found is None:
        return None
    name, field = found
    make = _extra(field).get("make")
    shown = (make if "=" in str(make) else f"{make}=") if make else ""
    return flag_of(name, field) + (f" (make {shown})" if shown else "")


def _explain(err: ValidationError, where: str, model: type[BaseModel] | None = None,
             options: bool = False) -> str:
    """One paragraph: the file (or command line), each bad field, what it should be; on the
    command line the field is named by its option and Makefile variable."""
    parts, seen = [], set()
    for problem in err.errors():
        if problem["loc"][:1] in seen:  # a union's other members: one line per field
            continue
        seen.add(problem["loc"][:1])
        loc = tuple(p for p in problem["loc"] if not str(p).startswith(
            ("constrained-", "literal[", "function-")))
        field = ".".join(map(str, loc))
        if problem["type"] == "extra_forbidden":
            known = _fields_at(model, loc)
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            parts.append(f"unknown field {field!r}" + (f" (did you mean {close[0]!r}?)" if close
                                                       else "")
                         + (f"; the fields are {', '.join(known)}" if known else ""))
        else:
            named = _option_name(model, loc) if options else None
            parts.append(f"{named or f'field {field!r}'}: {problem['msg'].lower()} (got "
                         f"{problem.get('input')!r})")
    return f"{where}: " + "; ".join(parts) + "."


def overrides(model: type[BaseModel], names: tuple[str, ...], source: str) -> type[BaseModel]:
    """A settings model of ``model``'s fields ``names``, each unset by default (None, or ``()``
    for a list), so that it overrides ``source`` only where it is given. Its fields keep the
    stage's type, bounds, flag and Makefile variable: an option is declared once, by its stage,
    and composed into the settings of whatever runs that stage (the campaign)."""
    from pydantic import Field, create_model

    fields: dict[str, Any] = {}
    for name in names:
        field = model.model_fields[name]
        inner, _ = _bare(field.annotation)
        many = get_origin(inner) in (list, tuple)
        kind = Annotated[(inner, *field.metadata)] if field.metadata else inner
        said = (field.description or name).split(" (default")[0]
        fields[name] = (kind if many else typing.Optional[kind],  # noqa: UP045 (a runtime type)
                        Field(() if many else None, description=f"{said} (default: {source})",
                              json_schema_extra=_extra(field) or None))
    return create_model(f"{model.__name__.removesuffix('Settings')}Overrides",
                        __config__=ConfigDict(frozen=True, extra="forbid"), **fields)


# --- fields every stage shares ------------------------------------------------------------------
DEFAULT_BASELINE = "smollm2-135m-instruct"


def baseline_field() -> Any:
    from pydantic import Field

    return Field(DEFAULT_BASELINE, description="embedded alias, local model directory or hub id",
                 json_schema_extra={"make": "BASELINE"})


def recipes_field(what: str) -> Any:
    from pydantic import Field

    return Field((), description=f"a variant to {what} (default: every variant on disk)",
                 json_schema_extra={"flag": "--recipe", "make": "RECIPE"})


def force_field(what: str) -> Any:
    from pydantic import Field

    return Field(False, description=f"{what} even if unchanged", json_schema_extra={
        "make": "FORCE=1"})


class StageSettings(BaseModel):
    """Settings of one stage: frozen, unknown fields refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def command(self, stage: str) -> str:
        """The command that runs this stage alone with these settings."""
        import shlex

        return shlex.join(["qpipe", stage, *to_argv(self)])
