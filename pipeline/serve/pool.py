"""Servers kept up from one stage to the next (a campaign's bench, then its eval).

On a CPU host a start costs ~40 s per model; the pool pays it once. Servers are keyed by
checkpoint, served name and engine settings, so a stage only reuses a server started exactly
as it would start one itself (eval accepts either prefix-caching setting: scores do not depend
on it). Whatever is still up is stopped on exit.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.core.hardware import serve_target
from pipeline.serve.server import VllmServer, stop_servers
from pipeline.serve.settings import EngineSettings

Key = tuple[str, str, EngineSettings]


class ServerPool:
    def __init__(self) -> None:
        self._servers: dict[Key, VllmServer] = {}

    @staticmethod
    def _key(model_dir: Path, served_name: str, settings: EngineSettings) -> Key:
        return str(Path(model_dir).resolve()), served_name, settings.resolved(serve_target())

    def get(self, model_dir: Path, served_name: str, settings: EngineSettings,
            any_caching: bool = False) -> VllmServer | None:
        """The running server for exactly these settings, if the pool holds one."""
        options = [settings]
        if any_caching:
            options.append(settings.model_copy(
                update={"enable_prefix_caching": not settings.enable_prefix_caching}))
        for wanted in options:
            server = self._servers.get(self._key(model_dir, served_name, wanted))
            if server is not None and server.alive():
                return server
        return None

    def keep(self, server: VllmServer) -> None:
        self._servers[self._key(server.model_dir, server.served_name, server.settings)] = server

    def holds(self, server: VllmServer) -> bool:
        return any(s is server for s in self._servers.values())

    def discard(self, server: VllmServer) -> None:
        """Forget (and stop) a server that failed: no later stage is lent it."""
        self._servers = {k: s for k, s in self._servers.items() if s is not server}
        server.stop()

    def close(self) -> None:
        """Stop every server, all shutting down at once."""
        stop_servers(list(self._servers.values()))
        self._servers.clear()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
