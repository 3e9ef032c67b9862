"""Building the real agent image for end-to-end tests (offline, on the test base image)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from mdclaw.commands.containers import image_backends
from mdclaw.runtime.docker_engine import DockerRuntime

BASE_IMAGE = os.environ.get("MDCLAW_TEST_BASE_IMAGE", "mdclaw-test-base")


def build_agent_image(engine: DockerRuntime, context: Path, tag: str, *,
                      claude: bool = False) -> str:
    """Build container/Dockerfile (under `context`) offline on the test base image, after
    making its wheelhouse when it has none; return `tag`."""
    import sys

    import docker

    wheelhouse = context / "container" / "wheelhouse"
    if claude or not any(wheelhouse.glob("inotify_simple-*.whl")):
        subprocess.run([str(context / "container" / "build-wheelhouse.sh"),
                        *(["--claude"] if claude else [])], check=True, timeout=900,
                       env={**os.environ, "PYTHON": sys.executable}, stdout=subprocess.DEVNULL)
    api = docker.APIClient(base_url=engine.base_url, timeout=1800)
    for item in api.build(path=str(context), dockerfile="container/Dockerfile", tag=tag,
                          buildargs={"BASE_IMAGE": BASE_IMAGE,
                                     "MDCLAW_BACKENDS": image_backends(context, {})},
                          rm=True, forcerm=True,
                          pull=False, decode=True):
        if "error" in item:
            pytest.fail(f"image build failed: {item['error']}")
    return tag
