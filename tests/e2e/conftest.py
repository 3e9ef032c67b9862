"""A real container engine for the end-to-end tests.

The engine is found the way mdclaw finds it (DOCKER_HOST, then the usual sockets). When none
answers but `podman` is installed, a private `podman system service` is started on a socket in
a temporary directory for the session. When there is still no engine, or the test base image
`mdclaw-test-base` (made by .ci/setup-engine) is missing, the tests FAIL under CI=true and are
skipped with the reason elsewhere.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from mdclaw.runtime import EngineUnavailable, find_socket
from mdclaw.runtime.docker_engine import DockerRuntime

BASE_IMAGE = os.environ.get("MDCLAW_TEST_BASE_IMAGE", "mdclaw-test-base")
HERE = Path(__file__).resolve().parent
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but {reason}; .ci/setup-engine should have provided it",
                    pytrace=False)
    pytest.skip(f"{reason} (run `. .ci/setup-engine` to set one up)")


def _try(url: str) -> DockerRuntime | None:
    rt = DockerRuntime(url, engine="podman" if "podman" in url else "docker")
    try:
        rt.ping()
    except EngineUnavailable:
        return None
    return rt


@pytest.fixture(scope="session")
def engine():
    """A DockerRuntime connected to a live engine (dockerd or Podman)."""
    url = find_socket()
    rt = _try(url)
    proc = None
    tmp = None
    if rt is None and shutil.which("podman"):
        tmp = tempfile.mkdtemp(prefix="mdclaw-podman-")
        sock = os.path.join(tmp, "podman.sock")
        env = dict(os.environ)
        if not env.get("CONTAINERS_CONF"):
            # The settings .ci/setup-engine uses: podman's default ulimits are refused in
            # some sandboxes, and systemd is not always there for cgroups or events.
            conf = os.path.join(tmp, "containers.conf")
            Path(conf).write_text(CONTAINERS_CONF)
            env["CONTAINERS_CONF"] = conf
        proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{sock}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, env=env)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and rt is None:
            time.sleep(0.2)
            if os.path.exists(sock):
                rt = _try(f"unix://{sock}")
        if rt is not None:
            os.environ["DOCKER_HOST"] = f"unix://{sock}"  # for CLI subprocesses
    if rt is None:
        if proc:
            proc.terminate()
            proc.wait(10)
        _unavailable(f"no container engine answers at {url}")
    if rt.image_info(BASE_IMAGE) is None:
        _unavailable(f"the engine at {rt.base_url} has no test base image {BASE_IMAGE!r}")
    yield rt
    if proc:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def agent_image(engine: DockerRuntime, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small image on the base: python3 and tests/e2e/fake_agent.py (no network needed)."""
    ctx = tmp_path_factory.mktemp("image")
    shutil.copy(HERE / "fake_agent.py", ctx / "fake_agent.py")
    (ctx / "Dockerfile").write_text(
        f"FROM {BASE_IMAGE}\n"
        "COPY fake_agent.py /opt/fake_agent.py\n"
        'ENTRYPOINT ["python3", "-u", "/opt/fake_agent.py"]\n'
    )
    # Named by its content: test runs from other checkouts on the same engine, with another
    # fake_agent.py, build their own tag instead of replacing this one under our feet.
    digest = hashlib.sha256((ctx / "fake_agent.py").read_bytes()).hexdigest()[:12]
    tag = f"mdclaw-e2e-agent:{digest}"
    engine.build_image(tag, ctx / "Dockerfile", ctx)
    return tag


@pytest.fixture
def install_id() -> str:
    """A fresh install label per test, so tests never see each other's containers."""
    return f"e2e-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def reap(engine: DockerRuntime):
    """Label sets registered here are cleaned up after the test, whatever happened."""
    sets: list[dict[str, str]] = []
    yield sets.append
    for labels in sets:
        engine.cleanup(labels)


AGENT_TAG = "mdclaw-agent:e2e"
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session")
def real_agent_image(engine: DockerRuntime) -> str:
    """container/Dockerfile built offline on the test base, with a fresh wheelhouse."""
    from e2e_images import build_agent_image

    return build_agent_image(engine, REPO, AGENT_TAG)
