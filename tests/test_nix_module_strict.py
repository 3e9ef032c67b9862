"""services.mdclaw against strict stand-ins for the NixOS options it sets (runs whenever
NIXPKGS_LIB is set): misspelt options fail, nixpkgs' podman/docker/users assertions meet the
module, data_dir and engine mistakes are refused in mdclaw's words, the Claude image needs
its licence accepted, the admin's wrapper runs commands as the service, and the rendered
units pass `systemd-analyze verify` and keep `systemd-analyze security` at or below 1.7.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from nixeval import eval_module, eval_module_raw, nixpkgs_lib

MAIN = 'settings.groups.main = { name = "Admin"; jid = "hl:main"; main = true; };'
CLAUDE = 'settings.models.c = { backend = "claude"; model = "claude-sonnet-4-5"; };'


@pytest.fixture(scope="module")
def lib() -> Path:
    return nixpkgs_lib()


def module(body: str, extra: str = "") -> str:
    return "{ services.mdclaw = { enable = true; " + body + " }; " + extra + " }"


def fails(lib: Path, tmp_path: Path, config: str, *messages: str,
          allow_claude_code: bool = False) -> None:
    r = eval_module_raw(lib, tmp_path, config, allow_claude_code=allow_claude_code)
    assert r.returncode != 0, f"evaluation should fail:\n{config}"
    for m in messages:
        assert m in r.stderr, r.stderr[-3000:]


# --------------------------------------------------------------------------- strict stand-ins

@pytest.mark.parametrize("extra,message", [
    ("virtualisation.podman.dockerSocket.enabled = true;",
     "virtualisation.podman.dockerSocket.enabled' does not exist"),
    ("systemd.services.mdclaw.reloadTrigger = [ ];",
     "systemd.services.mdclaw.reloadTrigger' does not exist"),
    ("systemd.services.mdclaw.serviceConfig.ProtectHome = { a = 1; };",
     "is not of type"),
    ("users.users.mdclaw.extraGroup = [ \"x\" ];", "users.users.mdclaw.extraGroup' does not exist"),
    ("networking.firewall.allowedTCPPort = [ 1 ];", "allowedTCPPort' does not exist"),
], ids=["dockerSocket.enabled", "reloadTrigger", "unit value type", "extraGroup", "firewall"])
def test_a_misspelt_nixos_option_fails(lib: Path, tmp_path: Path, extra: str,
                                       message: str) -> None:
    fails(lib, tmp_path, module(MAIN, extra), message)


def test_nixpkgs_users_assertions_are_modelled(lib: Path, tmp_path: Path) -> None:
    fails(lib, tmp_path, module(MAIN, "users.users.mdclaw.isNormalUser = true;"),
          "Exactly one of users.users.mdclaw.isSystemUser and users.users.mdclaw.isNormalUser")


def test_every_group_the_units_name_exists(lib: Path, tmp_path: Path) -> None:
    for engine in ("podman", "docker"):
        r = eval_module(lib, tmp_path, module(f'containerEngine = "{engine}"; ' + MAIN))
        for unit in (r["unit"], r["imageUnit"]):
            sc = unit["serviceConfig"]
            assert {sc["Group"], *sc["SupplementaryGroups"]} <= set(r["groups"]), engine


# --------------------------------------------------------------------------- engines

def test_podman_beside_dockerd_evaluates(lib: Path, tmp_path: Path) -> None:
    """mdclaw no longer claims /run/docker.sock: a host running dockerd for other things
    can use Podman for mdclaw."""
    r = eval_module(lib, tmp_path, module(MAIN, "virtualisation.docker.enable = true;"))
    assert r["podman"]["dockerSocket"]["enable"] is False and r["docker"]["enable"] is True


def test_engine_conflicts_fail_in_mdclaw_words(lib: Path, tmp_path: Path) -> None:
    fails(lib, tmp_path, module(MAIN, "virtualisation.docker.enable = true; "
                                      "virtualisation.podman.dockerSocket.enable = true;"),
          'services.mdclaw.containerEngine = "podman": mdclaw talks to /run/podman/podman.sock',
          "Turn virtualisation.podman.dockerSocket.enable off",
          # and nixpkgs' own message, as on a real host
          "only one can serve the socket")
    fails(lib, tmp_path, module('containerEngine = "docker"; ' + MAIN,
                                "virtualisation.podman.enable = true; "
                                "virtualisation.podman.dockerSocket.enable = true;"),
          'services.mdclaw.containerEngine = "docker" talks to dockerd at /run/docker.sock')
    fails(lib, tmp_path, module('containerEngine = "docker"; ' + MAIN,
                                "virtualisation.podman.enable = true; "
                                "virtualisation.podman.dockerCompat = true;"),
          "virtualisation.podman.dockerCompat", "Option dockerCompat conflicts with docker")


# --------------------------------------------------------------------------- data_dir

BAD_DATA_DIRS = {
    "/": "shares", "/var": "shares", "/var/lib": "shares", "/home": "shares",
    "/srv": "shares", "/opt": "shares", "/tmp": "shares", "/mnt": "shares",
    "/var/lib/": "plain path", "/var/lib/../etc": "plain path", "/srv//mdclaw": "plain path",
    "/nix/store/abc-mdclaw": "/nix/", "/nix/var/mdclaw": "/nix/", "/tmp/mdclaw": "/tmp/",
    "/run/mdclaw": "/run/", "/etc/mdclaw": "/etc/", "/usr/share/mdclaw": "/usr/",
    "/home/alice/mdclaw": "ProtectHome", "/root/mdclaw": "ProtectHome",
}


@pytest.mark.parametrize("data_dir", sorted(BAD_DATA_DIRS))
def test_data_dir_must_be_a_folder_of_its_own(lib: Path, tmp_path: Path, data_dir: str) -> None:
    fails(lib, tmp_path, module(MAIN + f' settings.data_dir = "{data_dir}";'),
          f'services.mdclaw.settings.data_dir = "{data_dir}"', BAD_DATA_DIRS[data_dir],
          'settings.data_dir = "/var/lib/mdclaw" (the default) or "/srv/mdclaw"')


@pytest.mark.parametrize("data_dir", ["/var/lib/mdclaw", "/var/lib/mdclaw/home",
                                      "/srv/mdclaw", "/data/mdclaw", "/mnt/disk1/mdclaw"])
def test_good_data_dirs(lib: Path, tmp_path: Path, data_dir: str) -> None:
    r = eval_module(lib, tmp_path, module(MAIN + f' settings.data_dir = "{data_dir}";'))
    assert r["unit"]["serviceConfig"]["WorkingDirectory"] == data_dir


# --------------------------------------------------------------------------- images

def test_openai_only_gets_the_free_image(lib: Path, tmp_path: Path) -> None:
    r = eval_module(lib, tmp_path, module(MAIN))
    assert r["settings"]["runtime"]["image"] == "mdclaw-agent:0123abcd"


def test_claude_image_from_a_nixpkgs_that_refuses_claude_code(lib: Path, tmp_path: Path) -> None:
    fails(lib, tmp_path, module(MAIN + CLAUDE),
          "services.mdclaw.image is the Claude image",
          'nixpkgs.config.allowUnfreePredicate = pkg: builtins.elem (lib.getName pkg) '
          '[ "claude-code" ];')
    r = eval_module(lib, tmp_path, module(MAIN + CLAUDE), allow_claude_code=True)
    assert r["settings"]["runtime"]["image"] == "mdclaw-agent:c1a0de00"


def test_claude_model_with_the_free_image_fails(lib: Path, tmp_path: Path) -> None:
    fails(lib, tmp_path, module(MAIN + CLAUDE + " image = pkgs.mdclaw-agent-image;")
          .replace("{ services", "{ pkgs, ... }: { services"),
          'settings.models.c use backend "claude"', "holds only the openai backend",
          "container-image-claude")


# --------------------------------------------------------------------------- web server

def test_the_web_server_gets_a_token_by_default(lib: Path, tmp_path: Path) -> None:
    r = eval_module(lib, tmp_path, module(MAIN))
    assert r["settings"]["server"] == {"generate_secret": True}
    assert "channels" not in r["settings"]
    r = eval_module(lib, tmp_path, module(MAIN + " settings.server.generate_secret = false;"))
    assert r["settings"]["server"] == {"generate_secret": False}  # laptop-like
    # the token's old names stand alone: the module adds no second, different value
    for old in ("generate_secret = false;", 'secret_file = "/run/secrets/web";'):
        r = eval_module(lib, tmp_path, module(MAIN + f" settings.channels.http.{old}"))
        assert "server" not in r["settings"], r["settings"]


def test_open_firewall(lib: Path, tmp_path: Path) -> None:
    r = eval_module(lib, tmp_path, module(
        MAIN + ' openFirewall = true; settings.server.listen = "0.0.0.0:8080";'))
    assert r["firewall"] == [8080]
    # the old name of server.listen opens the same port
    r = eval_module(lib, tmp_path, module(
        MAIN + ' openFirewall = true; settings.channels.http.listen = "0.0.0.0:8081";'))
    assert r["firewall"] == [8081]
    # the chat off, the page and /metrics still are served: the port opens
    r = eval_module(lib, tmp_path, module(
        MAIN + ' openFirewall = true; settings.server.listen = "0.0.0.0:8080"; '
               "settings.channels.http.enabled = false;"))
    assert r["firewall"] == [8080]
    assert eval_module(lib, tmp_path, module(MAIN))["firewall"] == []
    fails(lib, tmp_path, module(MAIN + " openFirewall = true;"),
          "services.mdclaw.openFirewall", 'listen = "127.0.0.1:3000" listens on loopback only',
          'settings.server.listen = "0.0.0.0:3000"')
    fails(lib, tmp_path, module(
        MAIN + ' openFirewall = true; settings.channels.http.listen = "127.0.0.1:8080";'),
          'settings.channels.http.listen = "127.0.0.1:8080" listens on loopback only')
    fails(lib, tmp_path, module(
        MAIN + ' openFirewall = true; settings.server = { listen = "0.0.0.0:8080"; '
               "generate_secret = false; };"),
          "without a token", "generate_secret = true")


def test_meta(lib: Path, tmp_path: Path) -> None:
    r = eval_module(lib, tmp_path, module(MAIN))
    assert r["meta"]["doc"].endswith("/docs/nixos.md") and Path(r["meta"]["doc"]).is_file()
    assert r["meta"]["maintainers"] == []


# --------------------------------------------------------------------------- the admin's CLI

CREDS = ' credentials = { model = "/run/secrets/model key"; tg = "/run/agenix/tg"; };'


def test_wrapper_is_what_the_admin_runs(lib: Path, tmp_path: Path) -> None:
    r = eval_module(lib, tmp_path, module(MAIN + CREDS))
    [wrapper] = r["systemPackages"]
    assert wrapper["name"] == "mdclaw"  # the package itself is not on the PATH
    text = wrapper["text"]
    assert "export MDCLAW_CONFIG=/etc/mdclaw/config.yaml" in text
    assert "--uid=mdclaw --gid=mdclaw --property=SupplementaryGroups=podman" in text
    # the same credentials as the unit's LoadCredential=, quoted for the shell
    assert r["unit"]["serviceConfig"]["LoadCredential"] == [
        "model:/run/secrets/model key", "tg:/run/agenix/tg"]
    assert "--property=LoadCredential='model:/run/secrets/model key'" in text
    assert "--property=LoadCredential=tg:/run/agenix/tg" in text
    assert "--working-directory=/var/lib/mdclaw" in text


def _runnable_wrapper(text: str, tmp_path: Path) -> tuple[Path, Path]:
    """The wrapper with its store paths pointing at stand-ins that record their arguments."""
    log = tmp_path / "calls.log"
    stub = tmp_path / "stub"
    stub.write_text(f'#!/bin/sh\n{{ echo "$0"; for a in "$@"; do echo "  $a"; done; '
                    f'echo "  MDCLAW_CONFIG=$MDCLAW_CONFIG"; }} >> {log}\n')
    tmp_path.chmod(0o777)  # the unprivileged run writes its log here too
    stub.chmod(0o755)
    os.symlink(stub, tmp_path / "systemd-run")
    os.symlink(stub, tmp_path / "mdclaw-real")
    text = re.sub(r"/nix/store/[^ ]*/bin/systemd-run", str(tmp_path / "systemd-run"), text)
    text = re.sub(r"/nix/store/[^ ]*/bin/mdclaw", str(tmp_path / "mdclaw-real"), text)
    script = tmp_path / "mdclaw"
    script.write_text("#!/bin/sh\n" + text)
    script.chmod(0o755)
    return script, log


def test_wrapper_runs_as_the_service_for_root_and_directly_for_others(
        lib: Path, tmp_path: Path) -> None:
    r = eval_module(lib, tmp_path, module(MAIN + CREDS))
    base = Path(tempfile.mkdtemp(prefix="mdclaw-wrapper-"))  # readable by an unprivileged user
    base.chmod(0o755)
    try:
        _check_wrapper(r["systemPackages"][0]["text"], base)
    finally:
        shutil.rmtree(base)


def _check_wrapper(text: str, tmp_path: Path) -> None:
    script, log = _runnable_wrapper(text, tmp_path)
    env = {"PATH": "/usr/bin:/bin"}

    def run(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        log.unlink(missing_ok=True)
        return subprocess.run([*prefix, str(script), *args], capture_output=True, text=True,
                              env=env, timeout=30, stdin=subprocess.DEVNULL)

    as_root = os.geteuid() == 0
    res = run("doctor", "--json")
    assert res.returncode == 0, res.stderr
    calls = log.read_text()
    if as_root:
        assert calls.startswith(str(tmp_path / "systemd-run"))
        assert "  --pipe\n" in calls  # stdin is not a terminal
        assert "  --property=LoadCredential=model:/run/secrets/model key\n" in calls
        assert "  --uid=mdclaw\n" in calls and "  --wait\n" in calls
        assert calls.split("  --\n", 1)[1].splitlines()[1:3] == ["  doctor", "  --json"]
    # anyone else (a member of the mdclaw group): the command itself, with the config path
    setpriv = shutil.which("setpriv")
    if as_root and setpriv:
        res = run("status", prefix=(setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"))
        assert res.returncode == 0, res.stderr
        calls = log.read_text()
        assert calls.startswith(str(tmp_path / "mdclaw-real"))
        assert "  status\n" in calls and "MDCLAW_CONFIG=/etc/mdclaw/config.yaml" in calls
    # the daemon is the service's job
    res = run("run")
    assert res.returncode == 2 and "systemctl start mdclaw" in res.stderr
    assert not log.exists()


# --------------------------------------------------------------------------- systemd-analyze

def render_unit(unit: dict) -> str:
    """The unit file NixOS writes for a systemd.services entry (systemd-lib's rendering:
    lists become repeated keys, booleans true/false, environment as Environment= lines)."""
    def value(v: object) -> str:
        return ("true" if v else "false") if isinstance(v, bool) else str(v)

    out = ["[Unit]"]
    if unit.get("description"):
        out.append(f"Description={unit['description']}")
    for key, name in (("wants", "Wants"), ("requires", "Requires"), ("after", "After"),
                      ("before", "Before"), ("bindsTo", "BindsTo"), ("partOf", "PartOf")):
        if unit.get(key):
            out.append(f"{name}={' '.join(unit[key])}")
    out.append("[Service]")
    for k, v in unit.get("environment", {}).items():
        out.append(f'Environment="{k}={v}"')
    for k, v in unit["serviceConfig"].items():
        if isinstance(v, list):
            if not v:
                continue  # an empty list writes nothing
            out.extend(f"{k}={value(x)}" for x in v)
        else:
            out.append(f"{k}={value(v)}")
    return "\n".join(out) + "\n"


def analyzer() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is missing; .ci/setup-tools installs systemd")
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    return tool


def write_unit(unit: dict, name: str, tmp_path: Path) -> Path:
    exe = tmp_path / "mdclaw-exe"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    text = render_unit(unit)
    text = re.sub(r"/nix/store/[^ \n]*/bin/mdclaw", str(exe), text)
    text = re.sub(r"/nix/store/[^ \n]*/bin/kill", shutil.which("kill") or "/bin/kill", text)
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def units(lib: Path, tmp_path_factory) -> dict[str, dict]:
    r = eval_module(lib, tmp_path_factory.mktemp("units"), module(
        MAIN + CREDS + ' settings.mount_policy.allowed_roots = [ { path = "/srv/notes"; } ];'))
    return {"mdclaw.service": r["unit"], "mdclaw-image.service": r["imageUnit"]}


def test_rendered_units_verify(units: dict, tmp_path: Path) -> None:
    """Both units together (the daemon requires the image loader), without one warning
    about either. The engine's podman.socket comes from the host's Podman package."""
    paths = [write_unit(unit, name, tmp_path) for name, unit in units.items()]
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""}
    proc = subprocess.run([analyzer(), "verify", "--man=no", *map(str, paths)],
                          capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    ours = [ln for ln in (proc.stdout + proc.stderr).splitlines()
            if any(name in ln for name in units) and "podman.socket" not in ln]
    assert ours == [], "\n".join(p.read_text() for p in paths) + "\n".join(ours)
    assert proc.returncode == 0 or all("podman.socket" in ln for ln in
                                       (proc.stdout + proc.stderr).splitlines() if ln), \
        proc.stdout + proc.stderr


def test_verify_would_catch_a_bad_value(units: dict, tmp_path: Path) -> None:
    unit = {**units["mdclaw.service"],
            "serviceConfig": {**units["mdclaw.service"]["serviceConfig"], "Type": "notfy"}}
    path = write_unit(unit, "mdclaw.service", tmp_path)
    proc = subprocess.run([analyzer(), "verify", "--man=no", str(path)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert "notfy" in proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["mdclaw.service", "mdclaw-image.service"])
def test_rendered_unit_exposure_stays_low(units: dict, name: str, tmp_path: Path) -> None:
    path = write_unit(units[name], name, tmp_path)
    proc = subprocess.run([analyzer(), "security", "--offline=true", "--threshold=20",
                           "--no-pager", str(path)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout + proc.stderr)
    assert m, proc.stdout + proc.stderr
    assert float(m.group(1)) <= 1.7, proc.stdout
