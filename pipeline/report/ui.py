"""``make ui``: the MLflow UI on 127.0.0.1 over qpipe's tracking store; Ctrl-C stops all of it."""

from __future__ import annotations

import os
import socket
import sys

from pydantic import Field

from pipeline.core import log as qlog
from pipeline.core import paths, procs, tracking
from pipeline.core.errors import ConfigError
from pipeline.core.settings import StageSettings
from pipeline.report.log import CHILD_STAGE
from pipeline.report.log import STAGE as CAMPAIGN_STAGE

log = qlog.get("ui")
WORKFLOW = "machine_learning"  # the UI's "Model training" view (its other: "genai")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) != 0


def server_command(port: int, host: str = "127.0.0.1") -> list[str]:
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
            paths.default_tracking_uri(), "--host", host, "--port", str(port), "--workers", "1"]


def server_env() -> dict[str, str]:
    # Without this, MLflow 3.17 starts huey job consumers in their own sessions that
    # outlive a SIGTERM to the server.
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "MLFLOW_ALLOW_FILE_STORE": "true"}


def newest_campaign(port: int) -> str:
    """Where to start reviewing: the newest campaign run's page and the comparison of its
    variants (MLflow's own views, linked); "" while no campaign is recorded."""
    mlflow = tracking.mlflow_module()
    stage = f"tags.`{tracking.TAG_STAGE}`"
    try:
        runs = mlflow.search_runs(search_all_experiments=True, max_results=1,
                                  filter_string=f"{stage} = '{CAMPAIGN_STAGE}'",
                                  order_by=["attributes.start_time DESC"], output_format="list")
        if not runs:
            return ""
        parent = runs[0].info
        children = mlflow.search_runs(
            [parent.experiment_id], output_format="list",
            filter_string=f"tags.`mlflow.parentRunId` = '{parent.run_id}' and "
            f"{stage} = '{CHILD_STAGE}'")  # its variants, not a stage run nested beside them
    except Exception:  # a view's convenience: the UI itself says what is wrong with the store
        return ""
    base = f"http://127.0.0.1:{port}/#/"
    view = f"workflowType={WORKFLOW}"  # MLflow 3 opens on its GenAI view without it
    ids = ",".join(f'"{c.info.run_id}"' for c in children)
    experiment = f"{base}experiments/{parent.experiment_id}"
    return (f"the runs: {experiment}/runs?{view}\n  the newest campaign, {parent.run_name}: "
            f"{experiment}/runs/{parent.run_id}?{view}\n  its variants side by side: "
            f'{base}compare-runs?runs=[{ids}]&experiments=["{parent.experiment_id}"]&{view}')


class UiSettings(StageSettings):
    port: int = Field(5000, ge=1, le=65535, description="port on 127.0.0.1",
                      json_schema_extra={"make": "MLFLOW_PORT"})


def run(settings: UiSettings) -> int:
    if not port_is_free(settings.port):
        raise ConfigError(f"port {settings.port} on 127.0.0.1 is in use (another `make ui`?): open "
                          f"http://127.0.0.1:{settings.port} or choose another with MLFLOW_PORT=.")
    log.info(f"MLflow UI on http://127.0.0.1:{settings.port} over {paths.default_tracking_uri()} "
             "(Ctrl-C stops it)")
    link = newest_campaign(settings.port)
    if link:
        log.info(link)
    proc = procs.start(server_command(settings.port), env=server_env(), die_with_parent=True)
    try:
        return proc.wait()
    finally:
        procs.stop(proc, timeout=15)
        log.info("stopped")
