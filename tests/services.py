"""Tests against real services: PostgreSQL, headless Chromium, an MLflow tracking server.

CI (``.ci/run``) installs PostgreSQL and Chromium with ``scripts/services.sh``, starts a
PostgreSQL server and exports

* ``QPIPE_TEST_POSTGRES_URI``: that server, e.g. ``postgresql://postgres@127.0.0.1:55432/postgres``
* ``QPIPE_REQUIRE_SERVICES=1``: a test whose service is missing fails instead of skipping.

By hand: ``scripts/services.sh install``, then
``export QPIPE_TEST_POSTGRES_URI=$(scripts/services.sh start-postgres)``.

Fixtures are used by naming them in the test module, not by ``from tests.services import
postgres_uri`` (ruff reports that as an unused import redefined by the test's argument, F401
and F811, and ``ruff --fix`` deletes it)::

    from tests import services

    postgres_uri = services.postgres_uri
    chromium_path = services.chromium_path

    def test_x(postgres_uri: str, chromium_path: str) -> None: ...
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from pipeline.core import procs

POSTGRES_ENV = "QPIPE_TEST_POSTGRES_URI"
REQUIRE_ENV = "QPIPE_REQUIRE_SERVICES"
CHROMIUM = "/usr/bin/chromium"
SETUP_HINT = ("scripts/services.sh install && "
              f"export {POSTGRES_ENV}=$(scripts/services.sh start-postgres)")

# Chromium as root on a machine with no network: no sandbox (root), no GPU, and none of the
# background connections it would otherwise try (and be refused) at every start.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                  "--mute-audio")


def services_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def unavailable(what: str) -> None:
    """Skip the test because ``what`` is missing; fail instead when QPIPE_REQUIRE_SERVICES=1."""
    message = f"{what} (set it up with: {SETUP_HINT})"
    if services_required():
        pytest.fail(f"{REQUIRE_ENV}=1 but {message}", pytrace=False)
    pytest.skip(message)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# --- PostgreSQL ---------------------------------------------------------------------------

def with_database(uri: str, database: str) -> str:
    """``uri`` pointing at another database on the same server."""
    parts = urllib.parse.urlsplit(uri)
    return urllib.parse.urlunsplit(parts._replace(path=f"/{database}"))


def _connect(uri: str) -> Any:
    import psycopg

    # autocommit: CREATE/DROP DATABASE cannot run in a transaction
    return psycopg.connect(uri, autocommit=True, connect_timeout=10)


@contextlib.contextmanager
def fresh_postgres_database(server_uri: str) -> Iterator[str]:
    """A new empty database ``qpipe_test_<random>`` on ``server_uri``'s server; yields its URI.

    Dropped on exit even while clients (an MLflow store's connection pool, a server) still hold
    connections to it: ``WITH (FORCE)`` ends them.
    """
    name = f"qpipe_test_{uuid.uuid4().hex[:12]}"
    connection = _connect(server_uri)
    try:
        with connection.cursor() as cursor:
            cursor.execute(f'CREATE DATABASE "{name}"')
        yield with_database(server_uri, name)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        connection.close()


@pytest.fixture
def postgres_uri() -> Iterator[str]:
    """The URI of a fresh PostgreSQL database (``$QPIPE_TEST_POSTGRES_URI``'s server), dropped
    after the test. MLflow takes it as it is: ``MLFLOW_TRACKING_URI=<it>``."""
    server_uri = os.environ.get(POSTGRES_ENV)
    if not server_uri:
        unavailable(f"{POSTGRES_ENV} is not set: no PostgreSQL server to test against")
    try:
        # SQLAlchemy 2.1's driver for plain postgresql:// URIs, MLflow's store included
        import psycopg  # noqa: F401
    except ImportError:
        unavailable("psycopg is not installed in this environment (requirements/pipeline.txt)")
    try:
        _connect(server_uri).close()
    except Exception as e:  # psycopg.OperationalError, with the server's own words
        pytest.fail(f"{POSTGRES_ENV}={server_uri} does not answer: {e}".strip(), pytrace=False)
    with fresh_postgres_database(server_uri) as uri:
        yield uri


# --- Chromium -----------------------------------------------------------------------------

@pytest.fixture
def chromium_path() -> str:
    """Debian's Chromium (package ``chromium``)."""
    if not os.access(CHROMIUM, os.X_OK):
        unavailable(f"{CHROMIUM} is missing (Debian package chromium)")
    return CHROMIUM


def _run_chromium(chromium: str, args: list[str], timeout: float) -> str:
    """Chromium headless with ``args`` in a fresh profile; its stdout. Killed, with every
    process it started, when it outlives ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="qpipe-chromium-") as profile:
        command = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it may end just after the timeout
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"chromium did not finish in {timeout:g} s: {' '.join(command)}"
                                 f"\n{_tail(err)}") from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # helpers left behind, if any
        if proc.returncode != 0:
            raise AssertionError(f"chromium exited with {proc.returncode}: {' '.join(command)}"
                                 f"\n{_tail(err)}")
        return out


def render_dom(html_path: str | os.PathLike[str], chromium: str = CHROMIUM,
               timeout: float = 60, budget_ms: int = 5000) -> str:
    """The DOM of a local HTML file after its scripts ran, serialized (``--dump-dom``).

    ``budget_ms`` of virtual time lets timers and animation frames run before the dump (it
    passes as fast as the page lets it, not in real time). The page is opened as
    ``file://`` with no extra permissions, as a user's browser opens it: a report that
    fetch()es its data from beside itself will not render here either.
    """
    url = Path(html_path).resolve().as_uri()
    return _run_chromium(chromium, [f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
                         timeout)


def screenshot(html_path: str | os.PathLike[str], chromium: str, png_path: str | os.PathLike[str],
               size: tuple[int, int] = (1280, 1600), timeout: float = 60,
               budget_ms: int = 5000) -> Path:
    """A PNG of a local HTML file as rendered at ``size`` (width, height); returns its path."""
    png = Path(png_path).resolve()
    png.unlink(missing_ok=True)
    url = Path(html_path).resolve().as_uri()
    _run_chromium(chromium, [f"--virtual-time-budget={budget_ms}", f"--window-size={size[0]},"
                             f"{size[1]}", f"--screenshot={png}", url], timeout)
    if not png.is_file() or png.stat().st_size == 0:
        raise AssertionError(f"chromium wrote no screenshot to {png}")
    return png


# --- MLflow -------------------------------------------------------------------------------

@contextlib.contextmanager
def tracking_uri(uri: str) -> Iterator[str]:
    """Log through mlflow's fluent API (``mlflow.start_run`` ...) to ``uri`` inside the block;
    the previous tracking URI and ``MLFLOW_TRACKING_URI`` come back afterwards."""
    import mlflow
    from mlflow.tracking._tracking_service import utils

    previous, previous_env = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield uri
    finally:
        mlflow.set_tracking_uri(previous)  # also sets or unsets MLFLOW_TRACKING_URI
        if previous_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


process_group = procs.group


def _describe(processes: Any) -> list[str]:
    return [f"{p.pid}: {procs.command_line(p)[:200] or '(gone)'}" for p in processes]


def _get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


@contextlib.contextmanager
def mlflow_server(backend_store_uri: str, artifacts_dir: str | os.PathLike[str],
                  startup_timeout: float = 120, env: dict[str, str] | None = None
                  ) -> Iterator[str]:
    """``mlflow server`` over ``backend_store_uri`` on 127.0.0.1 and a free port, in its own
    process group; yields its base URL (``http://127.0.0.1:<port>``) once ``/health`` answers.

    On exit the whole group is stopped (SIGTERM, SIGKILL after 15 s) and it is an error if any
    process of it, or one it started, is still alive or the port still answers.
    """
    artifacts = Path(artifacts_dir).resolve()
    artifacts.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_store_uri,
               "--artifacts-destination", str(artifacts), "--host", "127.0.0.1",
               "--port", str(port), "--workers", "1"]
    # As `make ui` runs it: MLflow's job consumers would otherwise start their own sessions
    # and outlive the server's process group.
    server_env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}
    server_env.pop("MLFLOW_TRACKING_URI", None)
    with tempfile.NamedTemporaryFile("w+", prefix="qpipe-mlflow-server-", suffix=".log") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=server_env,
                                start_new_session=True, cwd=artifacts.parent)
        family: list[psutil.Process] = []

        def server_log() -> str:
            log.flush()
            return _tail(Path(log.name).read_text(errors="replace"), 40)

        try:
            deadline = time.monotonic() + startup_timeout
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"mlflow server exited with {proc.returncode}: "
                                         f"{' '.join(command)}\n{server_log()}")
                try:
                    if _get(f"{base_url}/health", timeout=2).strip() == "OK":
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"mlflow server did not answer on {base_url}/health "
                                         f"in {startup_timeout:g} s\n{server_log()}")
                time.sleep(0.25)
            family = procs.family(proc)
            yield base_url
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            _, alive = psutil.wait_procs(family, timeout=15)
            left = {p.pid: p for p in [*alive, *process_group(proc.pid)]}
            leftover = _describe(left.values())
            for p in left.values():
                with contextlib.suppress(psutil.Error):
                    p.kill()
        # Not in `finally`: an error of the block itself must not be masked by these.
        assert not leftover, f"mlflow server left processes behind: {leftover}"
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"{base_url} still answers after stop"


def _rest(base_url: str, endpoint: str, payload: dict[str, Any] | None = None,
          query: dict[str, str] | None = None) -> dict[str, Any]:
    url = f"{base_url}/api/2.0/mlflow/{endpoint}"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{request.method} {url} -> HTTP {e.code}: "
                             f"{e.read().decode(errors='replace')[:500]}") from None


def rest_search_runs(base_url: str, experiment_name: str) -> list[dict[str, Any]]:
    """Every run of the experiment named ``experiment_name``, through MLflow's REST API
    (``experiments/get-by-name``, then ``runs/search`` page by page), as the API returns them:
    ``{"info": {"run_id", "run_name", "status", ...}, "data": {"metrics": [{"key", "value",
    "step", ...}], "params": [{"key", "value"}], "tags": [{"key", "value"}]}}``.
    :func:`rest_run_summary` flattens one."""
    experiment = _rest(base_url, "experiments/get-by-name",
                       query={"experiment_name": experiment_name})["experiment"]
    runs: list[dict[str, Any]] = []
    page_token = None
    while True:
        payload: dict[str, Any] = {"experiment_ids": [experiment["experiment_id"]],
                                   "max_results": 1000, "run_view_type": "ALL"}
        if page_token:
            payload["page_token"] = page_token
        body = _rest(base_url, "runs/search", payload)
        runs.extend(body.get("runs", []))
        page_token = body.get("next_page_token")
        if not page_token:
            return runs


def rest_run_summary(run: dict[str, Any]) -> dict[str, Any]:
    """One run of :func:`rest_search_runs` as ``{run_id, run_name, status, parent_run_id,
    params, metrics (latest values), tags}``."""
    data = run.get("data", {})
    tags = {t["key"]: t["value"] for t in data.get("tags", [])}
    return {
        "run_id": run["info"]["run_id"],
        "run_name": run["info"].get("run_name") or tags.get("mlflow.runName"),
        "status": run["info"].get("status"),
        "parent_run_id": tags.get("mlflow.parentRunId"),
        "params": {p["key"]: p["value"] for p in data.get("params", [])},
        "metrics": {m["key"]: m["value"] for m in data.get("metrics", [])},
        "tags": tags,
    }


# Tags that differ between two stores holding the same results: ids, and what depends on
# when, where and by whom the code ran.
VOLATILE_TAGS = frozenset({
    "mlflow.parentRunId",  # an id: the snapshot names the parent instead
    "mlflow.runName",  # the snapshot's key
    "mlflow.user", "mlflow.source.name", "mlflow.source.type", "mlflow.source.git.commit",
    "mlflow.source.git.branch", "mlflow.source.git.repoURL", "mlflow.gitRepoURL",
    "mlflow.log-model.history", "mlflow.databricks.notebookPath", "qpipe.host",
    "qpipe.campaign_id",  # one campaign's id: each run of a campaign has its own
})


def _metric(value: float) -> float | str:
    return "nan" if math.isnan(value) else value  # NaN != NaN would make equal stores differ


def store_snapshot(tracking_uri: str, experiment_name: str,
                   ignore_tags: frozenset[str] | set[str] = VOLATILE_TAGS) -> dict[str, Any]:
    """The runs of one experiment in a comparable form, by run name::

        {run_name: {"params": {...}, "metrics": {name: latest value}, "tags": {...} minus
                    ``ignore_tags``, "parent": the parent run's name or None}}

    Two stores holding the same results give equal snapshots, whatever their backend and run
    ids. An experiment that does not exist is an error; so is a run name used twice.
    """
    from mlflow.entities import ViewType
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        raise AssertionError(f"no experiment {experiment_name!r} in {tracking_uri}")
    runs = []
    page_token = None
    while True:
        page = client.search_runs([experiment.experiment_id], run_view_type=ViewType.ALL,
                                  max_results=1000, page_token=page_token)
        runs.extend(page)
        page_token = page.token
        if not page_token:
            break
    names = {run.info.run_id: run.info.run_name for run in runs}
    snapshot: dict[str, Any] = {}
    for run in runs:
        name = run.info.run_name
        if name in snapshot:
            raise AssertionError(f"run name {name!r} appears more than once in "
                                 f"{experiment_name!r} ({tracking_uri}): snapshots key by name")
        parent_id = run.data.tags.get("mlflow.parentRunId")
        snapshot[name] = {
            "params": dict(run.data.params),
            "metrics": {k: _metric(v) for k, v in run.data.metrics.items()},
            "tags": {k: v for k, v in run.data.tags.items() if k not in ignore_tags},
            "parent": names.get(parent_id, parent_id) if parent_id else None,
        }
    return snapshot
