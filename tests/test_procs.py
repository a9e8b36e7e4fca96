"""Listed processes that exit: the helpers of ``pipeline.core.procs`` treat a process that is gone
as not there, and no code in ``pipeline/`` or ``tests/`` asks the OS about a listed process
without handling its exit (a static check over the sources: a race there fails a fresh clone's
``make test`` by chance, or leaves a user a traceback at clean-up)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from pipeline.core import procs

ROOT = Path(__file__).resolve().parents[1]
# what only a psutil.Process answers (a Popen has none of these), and the os calls on a pid
PROCESS_CALLS = {"cmdline", "status", "environ", "memory_info", "memory_full_info", "children",
                 "ppid", "parent", "create_time", "cpu_percent", "num_threads", "open_files",
                 "name", "uids", "username", "cwd", "exe"}
OS_CALLS = {"getpgid", "getsid", "kill", "killpg"}
# exceptions whose handler covers a process that exited (psutil.NoSuchProcess, or the OS's ESRCH)
GUARDS = {"Error", "NoSuchProcess", "ProcessLookupError", "OSError", "Exception"}


def _guarded_names(node: ast.AST) -> set[str]:
    """The last names of the exceptions a handler or ``suppress(...)`` catches."""
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute):
            names.add(sub.attr)
        elif isinstance(sub, ast.Name):
            names.add(sub.id)
    return names


def _guards(node: ast.AST) -> bool:
    """Whether ``node`` is a ``try`` or ``with suppress(...)`` that handles a process's exit."""
    if isinstance(node, ast.Try):
        return any(h.type is None or _guarded_names(h.type) & GUARDS for h in node.handlers)
    if not isinstance(node, ast.With):
        return False
    return any(isinstance(call := item.context_expr, ast.Call)
               and getattr(call.func, "attr", getattr(call.func, "id", "")) == "suppress"
               and any(_guarded_names(a) & GUARDS for a in call.args) for item in node.items)


def _is_self(node: ast.AST) -> bool:
    """``psutil.Process()``, ``psutil.Process(os.getpid())``, ``os.getpid()``, ``0``: this very
    process, which cannot exit under its own feet."""
    if isinstance(node, ast.Constant) and node.value == 0:
        return True
    if isinstance(node, ast.Call):
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if name == "getpid":
            return True
        if name == "Process":
            return not node.args or _is_self(node.args[0])
    return False


def _asks_about_a_process(node: ast.Call) -> bool:
    """``os.getpgid(pid)`` and the like, or ``p.cmdline()`` and the like on another process."""
    if not isinstance(node.func, ast.Attribute):
        return False
    attr, owner = node.func.attr, node.func.value
    if isinstance(owner, ast.Name) and owner.id == "os":
        return attr in OS_CALLS and not (node.args and _is_self(node.args[0]))
    if attr not in PROCESS_CALLS or node.args or _is_self(owner):
        return False
    return not node.keywords or attr == "children"


def unguarded_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of each call that asks the OS about a process outside a handler of its
    exit."""
    tree = ast.parse(source)
    parents: dict[ast.AST, ast.AST] = {}
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            parents[child] = parent
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not _asks_about_a_process(node):
            continue
        up: ast.AST | None = parents.get(node)
        while up is not None and not _guards(up):
            up = parents.get(up)
        if up is None:
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_static_check_finds_an_unguarded_call_and_passes_a_guarded_one() -> None:
    racy = ("for p in psutil.process_iter():\n"
            "    with contextlib.suppress(psutil.Error):\n"
            "        if os.getpgid(p.pid) == 3:\n"
            "            pass\n"
            "    print(p.cmdline())\n"
            "os.killpg(proc.pid, 9)\n")
    assert [line for line, _ in unguarded_calls(racy)] == [5, 6]
    assert unguarded_calls("try:\n    p.status()\nexcept psutil.NoSuchProcess:\n    pass\n") == []
    assert unguarded_calls("psutil.Process().children(recursive=True)\nos.getpgid(0)\n") == []


def test_no_listed_process_is_asked_about_without_handling_its_exit() -> None:
    offenders = []
    for path in sorted([*ROOT.glob("pipeline/**/*.py"), *ROOT.glob("tests/*.py"),
                        *ROOT.glob("scripts/**/*.py")]):
        for line, call in unguarded_calls(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {call}")
    assert not offenders, ("calls on a process that may have exited, outside a handler of "
                           "psutil.Error / ProcessLookupError (use pipeline.core.procs):\n"
                           + "\n".join(offenders))


@pytest.fixture
def exited_child() -> psutil.Process:
    """A psutil handle on a child that has exited and been reaped (its pid is gone)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    handle = psutil.Process(proc.pid)
    proc.wait()
    return handle


def test_a_process_gone_between_listing_and_asking_is_not_in_the_group(
        monkeypatch: pytest.MonkeyPatch, exited_child: psutil.Process) -> None:
    mine = os.getpgid(0)
    monkeypatch.setattr(psutil, "process_iter", lambda: iter([exited_child, psutil.Process()]))
    assert [p.pid for p in procs.group(mine)] == [os.getpid()]


def test_a_gone_process_has_no_command_line_no_family_and_has_exited(
        exited_child: psutil.Process) -> None:
    assert procs.command_line(exited_child) == ""
    assert procs.family(exited_child.pid) == []
    assert procs.exited(exited_child.pid)
    assert not procs.exited(os.getpid())
    assert "pytest" in procs.command_line(psutil.Process()) or sys.argv[0] in \
        procs.command_line(psutil.Process())
