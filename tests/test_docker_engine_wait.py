"""How a run learns its exit status from the engine, against a real HTTP server speaking the
Docker Engine API on a unix socket (the SDK, the socket and the protocol are the real ones;
the server answers the way Podman does while a container exits)."""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from mdclaw.runtime import EngineCallError
from mdclaw.runtime.docker_engine import DockerRuntime, _DockerRun

CID = "c0ffee"
GONE = {"message": "read /proc/4242/cgroup: no such process"}  # what Podman said in CI
EXITED = {"Id": CID, "State": {"Status": "exited", "Running": False, "ExitCode": 3,
                               "OOMKilled": False}}

Answer = tuple[int, dict[str, Any]]


class FakeEngine:
    """GET /version, GET .../containers/<id>/json (inspect), POST .../containers/<id>/wait;
    `inspect` and `wait` give (status, body) for each call, `seen` records the paths."""

    def __init__(self, path: Path, inspect: Callable[[int], Answer],
                 wait: Callable[[int], Answer]) -> None:
        self.seen: list[str] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                engine.seen.append(self.path)
                if self.path.endswith("/version"):
                    self._answer(200, {"ApiVersion": "1.41", "Version": "4.3.1"})
                elif self.path.endswith(f"/containers/{CID}/json"):
                    self._answer(*inspect(sum(p.endswith("/json") for p in engine.seen)))
                else:
                    self._answer(404, {"message": "no such path"})

            def do_POST(self) -> None:  # noqa: N802
                engine.seen.append(self.path)
                if f"/containers/{CID}/wait" in self.path:
                    self._answer(*wait(sum("/wait" in p for p in engine.seen)))
                else:
                    self._answer(404, {"message": "no such path"})

            def address_string(self) -> str:
                return "unix"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

        self.server = Server(str(path), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def inspects(self) -> int:
        return sum(p.endswith("/json") for p in self.seen)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engine_with(tmp_path: Path) -> Iterator[Callable[..., tuple[FakeEngine, _DockerRun]]]:
    made: list[tuple[FakeEngine, _DockerRun]] = []

    def make(inspect: Callable[[int], Answer],
             wait: Callable[[int], Answer] = lambda n: (200, {"StatusCode": 7})
             ) -> tuple[FakeEngine, _DockerRun]:
        sock = tmp_path / f"engine{len(made)}.sock"
        engine = FakeEngine(sock, inspect, wait)
        rt = DockerRuntime(f"unix://{sock}", engine="podman")
        ours, _theirs = socket.socketpair()  # stands in for the attach stream
        run = _DockerRun(rt, CID, "mdclaw-family-1", ours, ours.makefile("rb"), b"")
        made.append((engine, run))
        return engine, run

    yield make
    for engine, run in made:
        run.close()
        engine.close()


def test_an_inspect_that_fails_while_the_container_exits_is_asked_again(engine_with) -> None:
    """Podman can answer 500 to an inspect of a container whose process is going away; the
    exit status comes from the next inspect, not an error of the run."""
    engine, run = engine_with(lambda n: (500, GONE) if n <= 2 else (200, EXITED))
    assert run.wait(10) == 3
    assert engine.inspects() == 3
    assert not any("/wait" in p for p in engine.seen)


def test_inspect_failing_until_the_deadline_falls_back_to_the_wait_endpoint(
        engine_with) -> None:
    engine, run = engine_with(lambda n: (500, GONE))
    assert run.wait(0.5) == 7
    assert engine.inspects() >= 2 and any("/wait" in p for p in engine.seen)
    # The pauses between the asks double (5 ms up to 200 ms): about 8 in 0.5 s, never a
    # busy loop (which would ask hundreds of times).
    assert engine.inspects() <= 20, engine.inspects()


def test_an_engine_error_from_the_wait_endpoint_is_the_runtime_error_the_runner_reports(
        engine_with) -> None:
    engine, run = engine_with(lambda n: (500, GONE),
                              wait=lambda n: (500, {"message": "something broke"}))
    with pytest.raises(EngineCallError, match="something broke"):
        run.wait(0.3)


def test_a_client_error_from_inspect_is_not_retried(engine_with) -> None:
    """Only the engine's own failures (5xx) are asked again; a 4xx means the question was
    wrong, and a container that is gone has no exit status (-1)."""
    engine, run = engine_with(lambda n: (400, {"message": "bad request"}))
    with pytest.raises(EngineCallError, match="bad request"):  # the error the runner reports
        run.wait(5)
    assert engine.inspects() == 1
    engine, run = engine_with(lambda n: (404, {"message": "no such container"}))
    assert run.wait(5) == -1
