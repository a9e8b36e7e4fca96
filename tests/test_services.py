"""The service helpers of tests/services.py work against the real services, and can fail."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import psutil
import pytest

from pipeline.core import procs
from tests import services

postgres_uri = services.postgres_uri
chromium_path = services.chromium_path

EXPERIMENT = "qpipe/services-test"


def log_nested_runs(tracking_uri: str) -> dict[str, str]:
    """A parent run with two nested children, as a campaign logs them; {run name: run id}."""
    import mlflow

    ids = {}
    with services.tracking_uri(tracking_uri):
        mlflow.set_experiment(EXPERIMENT)
        with mlflow.start_run(run_name="campaign", tags={"qpipe.stage": "campaign"}) as parent:
            ids["campaign"] = parent.info.run_id
            mlflow.log_params({"baseline": "tiny", "recipes": "fp8,int4"})
            for recipe, ratio in (("fp8", 1.65), ("int4", 2.38)):
                with mlflow.start_run(run_name=f"quantize:{recipe}", nested=True,
                                      tags={"qpipe.stage": "quantize"}) as child:
                    ids[f"quantize:{recipe}"] = child.info.run_id
                    mlflow.log_params({"recipe": recipe})
                    mlflow.log_metric("compression_ratio", ratio)
                    for step, value in ((1, 10.0), (4, 30.0), (16, 45.5)):
                        mlflow.log_metric("sweep.output_tokens_per_s", value, step=step)
            mlflow.log_metric("variants", 2)
    return ids


def sqlite_uri(path: Path) -> str:
    return f"sqlite:///{path}"


EXPECTED = {
    "campaign": {"params": {"baseline": "tiny", "recipes": "fp8,int4"},
                 "metrics": {"variants": 2.0}, "tags": {"qpipe.stage": "campaign"},
                 "parent": None},
    "quantize:fp8": {"params": {"recipe": "fp8"},
                     "metrics": {"compression_ratio": 1.65, "sweep.output_tokens_per_s": 45.5},
                     "tags": {"qpipe.stage": "quantize"}, "parent": "campaign"},
    "quantize:int4": {"params": {"recipe": "int4"},
                      "metrics": {"compression_ratio": 2.38, "sweep.output_tokens_per_s": 45.5},
                      "tags": {"qpipe.stage": "quantize"}, "parent": "campaign"},
}


def test_postgres_and_sqlite_stores_give_equal_snapshots(postgres_uri: str,
                                                         tmp_path: Path) -> None:
    import psycopg

    sqlite = sqlite_uri(tmp_path / "mlflow.db")
    log_nested_runs(postgres_uri)
    log_nested_runs(sqlite)

    # The runs really are in PostgreSQL's tables, not in some fallback store.
    with psycopg.connect(postgres_uri) as connection, connection.cursor() as cursor:
        cursor.execute("select name from runs order by name")
        assert [r[0] for r in cursor.fetchall()] == ["campaign", "quantize:fp8", "quantize:int4"]

    in_postgres = services.store_snapshot(postgres_uri, EXPERIMENT)
    in_sqlite = services.store_snapshot(sqlite, EXPERIMENT)
    assert in_postgres == in_sqlite
    # Not merely equal: the system tags are in the store, yet filtered out of the snapshot.
    assert in_sqlite == EXPECTED

    # One changed value, and the snapshots tell the stores apart.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sqlite)
    child = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id],
                               filter_string="attributes.run_name = 'quantize:int4'")[0]
    client.log_metric(child.info.run_id, "sweep.output_tokens_per_s", 44.0, step=32)
    changed = services.store_snapshot(sqlite, EXPERIMENT)
    assert changed != in_postgres
    assert changed["quantize:int4"]["metrics"]["sweep.output_tokens_per_s"] == 44.0


def test_fresh_postgres_database_is_empty_and_dropped_with_open_connections(
        postgres_uri: str) -> None:
    import psycopg

    server = services.with_database(postgres_uri, "postgres")
    with services.fresh_postgres_database(server) as uri:
        name = uri.rsplit("/", 1)[1]
        assert name.startswith("qpipe_test_") and name != postgres_uri.rsplit("/", 1)[1]
        holder = psycopg.connect(uri)  # as an MLflow store's pool would hold one
        with holder.cursor() as cursor:
            cursor.execute("select count(*) from information_schema.tables "
                           "where table_schema = 'public'")
            assert cursor.fetchone() == (0,)
    holder.close()
    with psycopg.connect(server) as connection, connection.cursor() as cursor:
        cursor.execute("select count(*) from pg_database where datname = %s", (name,))
        assert cursor.fetchone() == (0,)


def test_snapshot_rejects_a_missing_experiment_and_duplicate_run_names(tmp_path: Path) -> None:
    import mlflow

    uri = sqlite_uri(tmp_path / "mlflow.db")
    with pytest.raises(AssertionError, match="no experiment"):
        services.store_snapshot(uri, EXPERIMENT)
    with services.tracking_uri(uri):
        mlflow.set_experiment(EXPERIMENT)
        for _ in range(2):
            with mlflow.start_run(run_name="twice"):
                pass
    with pytest.raises(AssertionError, match="'twice' appears more than once"):
        services.store_snapshot(uri, EXPERIMENT)


@pytest.mark.slow
def test_mlflow_server_serves_nested_runs_over_rest_and_stops_cleanly(tmp_path: Path) -> None:
    store = sqlite_uri(tmp_path / "mlflow.db")
    ids = log_nested_runs(store)
    with services.mlflow_server(store, tmp_path / "artifacts") as url:
        port = int(url.rsplit(":", 1)[1])
        server = next(c for c in psutil.net_connections("tcp")
                      if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN)
        try:
            pgid = os.getpgid(server.pid)
        except ProcessLookupError:
            pytest.fail(f"the mlflow server listening on {port} exited while serving")
        assert pgid != os.getpgid(0), "the server runs in a process group of its own"

        runs = {r["run_name"]: r for r in map(services.rest_run_summary,
                                               services.rest_search_runs(url, EXPERIMENT))}
        assert set(runs) == {"campaign", "quantize:fp8", "quantize:int4"}
        assert {n: r["run_id"] for n, r in runs.items()} == ids
        assert runs["campaign"]["parent_run_id"] is None
        for child in ("quantize:fp8", "quantize:int4"):
            assert runs[child]["parent_run_id"] == ids["campaign"]
            assert runs[child]["status"] == "FINISHED"
        assert runs["quantize:int4"]["metrics"]["compression_ratio"] == pytest.approx(2.38)
        assert runs["quantize:int4"]["params"] == {"recipe": "int4"}
        with pytest.raises(AssertionError, match="HTTP 404"):
            services.rest_search_runs(url, "qpipe/no-such-experiment")
    assert services.process_group(pgid) == []
    assert procs.exited(server.pid)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    return struct.unpack(">II", data[16:24])


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>report</title></head><body>
<h1>qpipe report</h1>
<svg id="plot" xmlns="http://www.w3.org/2000/svg" width="200" height="100">
  <rect x="10" y="10" width="60" height="80" fill="steelblue"/>
  <circle cx="140" cy="50" r="30" fill="orange"/>
</svg>
<div id="table-slot"></div>
<script>
  const rows = [["fp8", "1.65"], ["int4", "2.38"]];
  const table = document.createElement("table");
  table.id = "results";
  table.innerHTML = "<tr><th>recipe</th><th>ratio</th></tr>" +
    rows.map(r => "<tr><td>" + r[0] + "</td><td>" + r[1] + "</td></tr>").join("");
  document.getElementById("table-slot").appendChild(table);
  setTimeout(() => document.body.setAttribute("data-late", "ran"), 500);
</script>
</body></html>
"""


def test_render_dom_runs_the_page_scripts(chromium_path: str, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(PAGE)
    dom = services.render_dom(page, chromium_path)
    assert '<svg id="plot"' in dom and "<circle" in dom
    assert '<table id="results">' in dom, dom
    assert "<td>int4</td><td>2.38</td>" in dom
    assert 'data-late="ran"' in dom, "timers ran within the virtual-time budget"
    assert "<table" not in PAGE, "the table comes from the script, not from the file"

    broken = tmp_path / "broken.html"
    broken.write_text(PAGE.replace('document.getElementById("table-slot")',
                                   'document.getElementById("no-such-slot")'))
    assert '<table id="results">' not in services.render_dom(broken, chromium_path)


def test_screenshot_writes_a_png_of_the_page(chromium_path: str, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(PAGE)
    png = services.screenshot(page, chromium_path, tmp_path / "report.png", size=(640, 480))
    assert _png_size(png) == (640, 480)
