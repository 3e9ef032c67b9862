"""Runtime selection, socket discovery, the engine-down retry loop, Apple CLI translation."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from mdclaw.config import Config, Runtime
from mdclaw.runtime import (
    EngineUnavailable,
    Mount,
    RunSpec,
    create_runtime,
    find_socket,
    install_id,
    install_labels,
    wait_for_engine,
)
from mdclaw.runtime.apple import (
    SECRETS_PATH,
    AppleContainerRuntime,
    docker_style_args,
    run_args,
    translate_args,
)
from mdclaw.runtime.docker_engine import DockerRuntime

# --------------------------------------------------------------------------- discovery


def test_socket_order_configured_then_docker_host_then_the_usual_paths() -> None:
    present = {"/var/run/docker.sock", "/run/podman/podman.sock", "/xdg/podman/podman.sock"}
    exists = present.__contains__
    env = {"DOCKER_HOST": "tcp://10.0.0.1:2375", "XDG_RUNTIME_DIR": "/xdg"}
    assert find_socket("/srv/engine.sock", env, exists) == "unix:///srv/engine.sock"
    assert find_socket("unix:///a.sock", env, exists) == "unix:///a.sock"
    assert find_socket(None, env, exists) == "tcp://10.0.0.1:2375"
    env.pop("DOCKER_HOST")
    assert find_socket(None, env, exists) == "unix:///var/run/docker.sock"
    present.discard("/var/run/docker.sock")
    assert find_socket(None, env, exists) == "unix:///run/podman/podman.sock"
    present.discard("/run/podman/podman.sock")
    assert find_socket(None, env, exists) == "unix:///xdg/podman/podman.sock"
    present.clear()
    assert find_socket(None, env, exists) == "unix:///run/docker.sock"  # names the first place


def test_run_docker_sock_wins_over_var_run(tmp_path: Path) -> None:
    exists = {"/run/docker.sock", "/var/run/docker.sock"}.__contains__
    assert find_socket(None, {}, exists) == "unix:///run/docker.sock"


def test_find_socket_sees_a_real_unix_socket(tmp_path: Path) -> None:
    path = tmp_path / "podman" / "podman.sock"
    path.parent.mkdir()
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    try:
        url = find_socket(None, {"XDG_RUNTIME_DIR": str(tmp_path)},
                          lambda p: p == str(path) or False)
        assert url == f"unix://{path}"
        from mdclaw.runtime import _is_socket

        assert _is_socket(str(path)) and not _is_socket(str(tmp_path))
    finally:
        s.close()


def test_create_runtime_picks_the_class_for_the_engine() -> None:
    rt = create_runtime(Runtime(engine="podman", socket="/run/podman/podman.sock"))
    assert isinstance(rt, DockerRuntime) and rt.base_url == "unix:///run/podman/podman.sock"
    assert isinstance(create_runtime(Runtime(engine="docker", socket="/x.sock")), DockerRuntime)
    assert isinstance(create_runtime(Runtime(engine="apple-container")), AppleContainerRuntime)


def test_install_label_defaults_to_a_hash_of_the_data_dir(tmp_path: Path) -> None:
    a = Config(data_dir=tmp_path / "a")
    b = Config(data_dir=tmp_path / "b")
    assert install_id(a) != install_id(b) and len(install_id(a)) == 12
    assert install_id(a) == install_id(Config(data_dir=tmp_path / "a"))
    named = Config(data_dir=tmp_path / "a", runtime={"install_id": "home"})
    assert install_labels(named) == {"mdclaw": "true", "mdclaw.install": "home"}


# --------------------------------------------------------------------------- engine down


def test_an_absent_socket_is_reported_not_raised_raw(tmp_path: Path) -> None:
    rt = DockerRuntime(f"unix://{tmp_path}/none.sock")
    with pytest.raises(EngineUnavailable) as e:
        rt.ping()
    assert "engine running" in str(e.value) or "socket" in str(e.value)


def test_a_socket_nobody_serves_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "dead.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))  # bound, never listening: connections are refused
    try:
        with pytest.raises(EngineUnavailable):
            DockerRuntime(f"unix://{path}").ping()
    finally:
        s.close()


def test_wait_for_engine_backs_off_reports_status_and_stops(tmp_path: Path) -> None:
    rt = DockerRuntime(f"unix://{tmp_path}/none.sock")
    lines: list[str] = []

    async def go():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, stop.set)
        return await wait_for_engine(rt, status=lines.append, stop=stop, first_delay=0.05,
                                     max_delay=0.2)

    assert asyncio.run(go()) is None
    assert len(lines) >= 3
    assert "unreachable" in lines[0] and "retrying in 0.05 s" in lines[0]
    assert "retrying in 0.1 s" in lines[1] and "retrying in 0.2 s" in lines[2]
    assert all("0.4" not in line for line in lines)  # capped at max_delay


# --------------------------------------------------------------------------- Apple


def _spec(**kw) -> RunSpec:
    base = dict(name="mdclaw-fam-1", image="mdclaw-agent:latest",
                labels={"mdclaw": "true"}, command=["run"],
                mounts=[Mount("/data/groups/fam", "/workspace/group", readonly=False),
                        Mount("/data/groups/global", "/workspace/global", readonly=True)],
                env={"TZ": "UTC", "HOME": "/home/node"}, memory="2g", cpus=2.0, pids=512,
                group_add=["100"])
    base.update(kw)
    return RunSpec(**base)


def test_translate_turns_volumes_into_bind_mounts() -> None:
    out, env = translate_args(["-i", "-v", "/h/a:/c/a", "--volume", "/h/b:/c/b:ro",
                               "--volume=/h/c:/c/c:rw", "--rm"])
    assert out == ["-i", "--mount", "type=bind,source=/h/a,target=/c/a",
                   "--mount", "type=bind,source=/h/b,target=/c/b,readonly",
                   "--mount", "type=bind,source=/h/c,target=/c/c", "--rm"]
    assert env == {}


def test_translate_collects_env_into_a_mounted_secrets_file(tmp_path: Path) -> None:
    out, env = translate_args(["-i", "-e", "A=1", "--env", "B=x=y", "--env=C="], tmp_path)
    assert env == {"A": "1", "B": "x=y", "C": ""}
    assert "-e" not in out and "--env" not in out
    assert out[-2:] == ["--mount",
                        f"type=bind,source={tmp_path}/secrets.json,target={SECRETS_PATH},readonly"]
    written = tmp_path / "secrets.json"
    assert json.loads(written.read_text()) == env
    assert written.stat().st_mode & 0o777 == 0o600


def test_translate_drops_options_the_cli_does_not_have() -> None:
    out, _ = translate_args(["--cap-drop", "ALL", "--security-opt=no-new-privileges",
                             "--read-only", "--pids-limit", "64", "--group-add", "100",
                             "--tmpfs", "/tmp:size=1m", "--init", "--memory", "1g"])
    assert out == ["--memory", "1g"]


@pytest.mark.parametrize("bad", [["-v", "/a:/b:/c:ro"], ["-v", ":/b"], ["-v", "/a:/b:z"],
                                 ["-v"], ["-e", "=x"]])
def test_translate_refuses_what_it_cannot_express(bad: list[str]) -> None:
    with pytest.raises(ValueError):
        translate_args(bad)


def test_run_args_for_a_spec(tmp_path: Path) -> None:
    argv = run_args(_spec(), tmp_path)
    assert argv[:2] == ["container", "run"]
    assert argv[-2:] == ["mdclaw-agent:latest", "run"]
    joined = " ".join(argv)
    assert "--mount type=bind,source=/data/groups/fam,target=/workspace/group " in joined
    assert "target=/workspace/global,readonly" in joined
    assert "--name mdclaw-fam-1" in joined and "--label mdclaw=true" in joined
    assert "--user 1000:1000" in joined and "--network none" in joined
    assert "-v" not in argv and "-e" not in argv and "--group-add" not in argv
    assert json.loads((tmp_path / "secrets.json").read_text()) == {"TZ": "UTC",
                                                                   "HOME": "/home/node"}


def test_docker_style_args_round_trip_the_spec() -> None:
    args = docker_style_args(_spec(env={}))
    assert "-v" in args and "/data/groups/global:/workspace/global:ro" in args
    assert ["--memory", "2g"] == args[args.index("--memory"):args.index("--memory") + 2]
    assert "--cpus" in args and "2" in args


def test_apple_runtime_without_the_cli_is_unavailable() -> None:
    rt = AppleContainerRuntime(binary="mdclaw-no-such-container-cli")
    with pytest.raises(EngineUnavailable):
        rt.ping()


def test_apple_build_passes_build_args_and_starts_the_system(tmp_path) -> None:
    """A stand-in `container` CLI (a shell script) records how it is called."""
    log = tmp_path / "calls.log"
    cli = tmp_path / "container"
    cli.write_text(f'#!/bin/sh\necho "$@" >> {log}\n[ "$1 $2" = "system status" ] && exit 1\n'
                   'echo "building..."\nexit 0\n')
    cli.chmod(0o755)
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    rt = AppleContainerRuntime(binary=str(cli))
    lines: list[str] = []
    tag = rt.build_image("mdclaw-agent:dev", tmp_path / "Dockerfile", tmp_path,
                         progress=lines.append, build_args={"BASE_IMAGE": "python:3.12-slim"})
    assert tag == "mdclaw-agent:dev"
    calls = log.read_text().splitlines()
    assert calls[:2] == ["system status", "system start"]
    assert calls[-1] == (f"build -t mdclaw-agent:dev -f {tmp_path / 'Dockerfile'} "
                         f"--build-arg BASE_IMAGE=python:3.12-slim {tmp_path}")
    assert "building..." in lines
