"""Error types raised where a fact is known; the CLI turns each into one clear paragraph."""


class QpipeError(Exception):
    """A user-facing error: its message names the file, field or layer and the way out."""

    exit_code = 2


class ConfigError(QpipeError):
    """Bad settings or a bad data file (YAML, JSON, JSONL)."""


class RecipeError(QpipeError):
    """A recipe that is missing, malformed or asks for something the model cannot take."""


class BaselineError(QpipeError):
    """A baseline model that cannot be found, read or converted."""


class OutputError(QpipeError):
    """An output location that cannot be written (missing, read-only, full)."""


class QuantizeError(QpipeError):
    """llmcompressor failed while quantizing."""


class PlanError(QpipeError):
    """The capacity planner got a config or settings it cannot plan for."""


class TrackingError(QpipeError):
    """The MLflow tracking store cannot be reached or refused a write."""


class Interrupted(QpipeError):
    """The run was interrupted (Ctrl-C or SIGTERM); partial output was removed."""

    exit_code = 130
