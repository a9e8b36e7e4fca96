"""The Ray executor (``EXECUTOR=ray``): a campaign's stages as the tasks of a Ray cluster
(``RAY_ADDRESS=`` for an existing cluster, without it a local Ray instance over this node's
CPUs and GPUs): one task per recipe to quantize, then the baseline's scores, then one task per
variant that benches it beside its own baseline server (the speedup is paired on one node) and
scores it. Every task's commands are the stage commands a user can run alone; the artifacts
directory is shared by every node (docs/scale-out.md).

A task is one or more ``qpipe <stage> ...`` commands run in order on one node, with the
resources it declares (GPUs, CPUs, custom resources); its output goes to a log file under the
shared artifacts directory. Ray retries a failed or lost task once, then it is reported with
its node and log. Every command runs in its own process group and dies with the worker that
runs it (PR_SET_PDEATHSIG), so no server outlives its task; Ctrl-C interrupts every task (its
command gets SIGTERM and cleans up), then kills what is left.
Ray is imported only when ``ray`` is chosen: the local executor starts no Ray process.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.campaign.jobs import Steps, qpipe
from pipeline.core import log as qlog
from pipeline.core import paths, procs, tracking
from pipeline.core.artifacts import Failure
from pipeline.core.errors import ConfigError
from pipeline.core.settings import to_argv

if TYPE_CHECKING:  # a Ray worker imports this module: only what running a task needs
    from pipeline.bench import BenchSettings
    from pipeline.eval import EvalSettings
    from pipeline.quantize.baseline import Baseline
    from pipeline.quantize.settings import QuantizeSettings
    from pipeline.serve import EngineSettings

log = qlog.get("all")
# what a task's commands need from the driver's environment on any node
FORWARDED = ("QPIPE_", "MLFLOW_", "HF_", "VLLM_", "SERVE_TARGET", "CUDA_VISIBLE_DEVICES")


class Ray:
    """A Ray cluster: every stage as tasks, each on the node Ray chooses."""

    def __init__(self, address: str | None, resources: str | None,
                 engine: EngineSettings) -> None:
        self.address, self.resources = address, ray_resources(resources)
        self.servers = engine.tensor_parallel_size * engine.pipeline_parallel_size
        self.logs = paths.artifacts_dir() / "logs"

    def steps(self, recipes: int, benches: bool) -> int:
        return 2 * recipes + 1  # each recipe quantized, the baseline's scores, each measured

    def _run(self, clock: Steps, label: str, tasks: list[Task]) -> list[Outcome]:
        clock.next(f"{label} on Ray: {len(tasks)} task(s)", max(1, len(tasks)))
        return run(tasks, self.address)

    def quantize(self, todo: list[QuantizeSettings], base: Baseline,
                 clock: Steps) -> list[Failure]:
        tracking.prepare(base.name)  # tasks that log at once must not race on a new store
        outcomes = self._run(clock, "quantize", [Task(
            f"quantize {q.recipe}", (qpipe("quantize", *to_argv(q)),),
            self.logs / f"quantize-{q.recipe}.log", gpus_if_any=1, resources=self.resources)
            for q in todo])
        return [Failure(variant=o.label.split(" ", 1)[1], stage="quantize", reason=o.reason,
                        log=o.log) for o in outcomes if not o.ok]

    def measure(self, recipes: tuple[str, ...], bench_settings: BenchSettings | None,
                eval_settings: EvalSettings, clock: Steps) -> list[Failure]:
        first = eval_settings.model_copy(update={"recipes": ("none",)})
        failures = [Failure(variant="baseline", stage="eval", reason=o.reason, log=o.log)
                    for o in self._run(clock, "baseline scores", [Task(
                        "eval baseline", (qpipe("eval", *to_argv(first)),),
                        self.logs / "eval-baseline.log", gpus_if_any=self.servers,
                        resources=self.resources)]) if not o.ok]
        measure = []
        for recipe in recipes:
            commands = []
            if bench_settings is not None:
                one = bench_settings.model_copy(update={"recipes": (recipe,)})
                commands.append(qpipe("bench", *to_argv(one)))
            one_eval = eval_settings.model_copy(update={"recipes": (recipe,)})
            commands.append(qpipe("eval", *to_argv(one_eval)))
            measure.append(Task(f"measure {recipe}", tuple(commands),
                                self.logs / f"measure-{recipe}.log", gpus_if_any=self.servers,
                                resources=self.resources))
        return failures + [
            Failure(variant=o.label.split(" ", 1)[1], stage="bench/eval",
                    reason=f"{o.reason} (node {o.node})", log=o.log)
            for o in self._run(clock, "bench + eval per variant", measure) if not o.ok]


def ray_resources(text: str | None) -> dict[str, float]:
    """``RAY_RESOURCES='{"h100": 1}'``: the custom resources every task asks for."""
    if not text:
        return {}
    try:
        found = json.loads(text)
        if isinstance(found, dict) and all(isinstance(v, (int, float)) for v in found.values()):
            return {str(k): float(v) for k, v in found.items()}
    except ValueError:
        pass
    raise ConfigError(f"RAY_RESOURCES={text}: a JSON object of resource -> amount, e.g. "
                      "'{\"h100\": 1}'.")


@dataclass(frozen=True)
class Task:
    """``commands`` (argv lists of ``qpipe`` sub-commands) run in order on one node."""

    label: str
    commands: tuple[tuple[str, ...], ...]
    log: Path
    num_cpus: float = 1
    gpus_if_any: float = 0  # GPUs it takes where the cluster has GPUs (none on a CPU cluster)
    resources: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    label: str
    ok: bool
    node: str  # host and Ray node id (local: this host)
    log: str
    reason: str = ""
    attempts: int = 1  # a failure is reported after its retry: 2
    seconds: float = 0.0


def forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED)}


def run_commands(commands: tuple[tuple[str, ...], ...], log_path: str, env: dict[str, str],
                 cwd: str) -> dict[str, str]:
    """Run ``commands`` in order, output appended to ``log_path``; raises on the first failure.
    What a Ray worker executes for one task."""
    host = socket.gethostname()
    try:
        import ray

        node = f"{host}/{ray.get_runtime_context().get_node_id()[:12]}"
    except Exception:  # not in a Ray worker
        node = host
    full_env = {**os.environ, **env}
    for argv in commands:
        proc = procs.start(argv, log=Path(log_path), env=full_env, cwd=Path(cwd),
                           die_with_parent=True)
        try:
            code = proc.wait()
        finally:
            procs.stop(proc, timeout=60)  # also on a cancel: nothing left behind
        if code != 0:
            raise TaskFailed(f"`qpipe {' '.join(argv[3:4])} ...` exited {code} on {node}; log: "
                             f"{log_path}: {_last_line(Path(log_path))}")
    return {"node": node}


class TaskFailed(RuntimeError):
    pass


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    mine = [ln for ln in lines if ln.startswith("qpipe ")]
    return (mine or lines or [""])[-1][:400]


def run(tasks: list[Task], address: str | None = None) -> list[Outcome]:
    """Run every task on the Ray cluster; one outcome per task (failures reported, not
    raised). The outcomes (node, attempts, seconds since submission) are appended to
    ``artifacts/logs/executor.jsonl``."""
    for task in tasks:
        task.log.parent.mkdir(parents=True, exist_ok=True)
        task.log.write_bytes(b"")
    outcomes = _run_ray(tasks, address)
    record = paths.artifacts_dir() / "logs" / "executor.jsonl"
    with record.open("a") as out:
        for outcome in outcomes:
            out.write(json.dumps(asdict(outcome)) + "\n")
    return outcomes


def _run_ray(tasks: list[Task], address: str | None) -> list[Outcome]:
    try:
        import ray
    except ImportError:
        raise ConfigError("EXECUTOR=ray needs Ray in the pipeline environment: `make all "
                          "EXECUTOR=ray` installs it (or `scripts/setup.sh ray`).") from None
    started_here = not ray.is_initialized()
    if started_here:
        # an existing cluster (RAY_ADDRESS= or the argument), else a local instance that
        # uses every CPU and GPU of this node
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or None,
                 log_to_driver=False, include_dashboard=False)
    log.info(f"Ray: {len(ray.nodes())} node(s), resources {_resources(ray)}")
    remote = ray.remote(max_retries=1, retry_exceptions=True)(run_commands)
    env, cwd = forwarded_env(), str(paths.PROJECT_ROOT)
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    submitted: dict[Any, tuple[Task, float]] = {}  # ref -> (its task, when it was submitted)
    for task in tasks:
        ref = remote.options(
            num_cpus=task.num_cpus, num_gpus=task.gpus_if_any if has_gpus else 0,
            resources=dict(task.resources), name=task.label).remote(
                task.commands, str(task.log), env, cwd)
        submitted[ref] = (task, time.monotonic())
    outcomes: dict[str, Outcome] = {}
    pending = list(submitted)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=30)
            for ref in done:
                task, since = submitted[ref]
                seconds = round(time.monotonic() - since, 1)
                try:
                    info = ray.get(ref)
                    outcomes[task.label] = Outcome(task.label, True, info["node"], str(task.log),
                                                   seconds=seconds)
                    log.info(f"{task.label}: done on {info['node']} in {seconds:.0f} s")
                except Exception as err:  # the task's own error after its retry, or a lost node
                    reason = str(getattr(err, "cause", None) or err).strip().splitlines()
                    outcomes[task.label] = Outcome(
                        task.label, False, _node_of(reason), str(task.log),
                        (reason or ["?"])[-1][:600], attempts=2, seconds=seconds)
                    log.warning(f"{task.label}: FAILED after a retry: "
                                f"{outcomes[task.label].reason}")
            if pending and not done:
                log.info(f"{len(pending)} task(s) running on the cluster")
    except BaseException:
        _cancel(ray, pending)
        raise
    finally:
        if started_here:
            ray.shutdown()
    return [outcomes[t.label] for t in tasks]


def _cancel(ray: Any, pending: list[Any], grace_s: float = 90) -> None:
    """Ctrl-C (or an error) on the driver: stop every task. First the task itself is
    interrupted, so that its command gets SIGTERM and removes its temp directories and stops
    its servers; a task still running after ``grace_s`` is killed with its worker (whose
    children Ray then kills)."""
    for ref in pending:
        ray.cancel(ref, force=False)
    _, left = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
    for ref in left:
        ray.cancel(ref, force=True)


def _node_of(lines: list[str]) -> str:
    for line in reversed(lines):
        if " on " in line and "exited" in line:
            return line.split(" on ", 1)[1].split(";", 1)[0]
    return "unknown (the node was lost)"


def _resources(ray: Any) -> str:
    total = ray.cluster_resources()
    return ", ".join(f"{k} {v:g}" for k, v in sorted(total.items())
                     if not k.startswith(("node:", "memory", "object_store")))
