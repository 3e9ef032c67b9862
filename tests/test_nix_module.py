"""services.mdclaw evaluated with nixpkgs' lib (runs whenever NIXPKGS_LIB is set).

Checks that the options type-check, that mistakes fail at evaluation, that the rendered
config is what `mdclaw check-config` accepts, and that the systemd unit carries the notify,
watchdog, reload and hardening settings. See tests/nix/eval-module.nix for the stubs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mdclaw.commands.schema import config_json_schema
from nixeval import eval_module, eval_module_raw, nixpkgs_lib


@pytest.fixture(scope="module")
def lib() -> Path:
    return nixpkgs_lib()


BASIC = """
{
  services.mdclaw = {
    enable = true;
    credentials.anthropic = "/run/secrets/anthropic";
    settings = {
      assistant = { name = "Andy"; timezone = "Europe/Berlin"; model = "claude"; };
      models.claude = {
        backend = "claude";
        model = "claude-sonnet-4-5";
        api_key_file = "$CREDENTIALS_DIRECTORY/anthropic";
      };
      models.local = { backend = "openai"; model = "qwen2.5:7b"; base_url = "http://127.0.0.1:11434/v1"; };
      groups.main = { name = "Admin"; jid = "hl:main"; main = true; requires_trigger = false; };
      groups.family = { name = "Family"; jid = "tg:-1001234"; trigger = "@Andy"; timeout = "10m"; model = "local"; };
      limits = { max_concurrent_containers = 3; container_timeout = "1h"; cpus = 1.5; };
      server.listen = "127.0.0.1:3000";
      tasks = [ { id = "morning"; group = "main"; prompt = "Good morning"; cron = "0 8 * * *"; } ];
    };
  };
}
"""


@pytest.fixture(scope="module")
def basic(lib: Path, tmp_path_factory) -> dict:
    return eval_module(lib, tmp_path_factory.mktemp("basic"), BASIC, allow_claude_code=True)


def module(body: str) -> str:
    return "{ services.mdclaw = { enable = true; " + body + " }; }"


MAIN = 'settings.groups.main = { name = "Admin"; jid = "hl:main"; main = true; };'


# --------------------------------------------------------------------------- the unit

def test_unit_is_notify_with_watchdog_reload_restart(basic: dict) -> None:
    unit = basic["unit"]
    sc = unit["serviceConfig"]
    assert sc["Type"] == "notify" and sc["NotifyAccess"] == "main"
    assert sc["WatchdogSec"] == "60s"
    assert sc["ExecReload"].endswith("/bin/kill -HUP $MAINPID")
    assert sc["Restart"] == "on-failure"
    assert sc["ExecStart"].endswith("/bin/mdclaw run --config /etc/mdclaw/config.yaml")
    assert unit["environment"]["MDCLAW_CONFIG"] == "/etc/mdclaw/config.yaml"
    assert unit["wantedBy"] == ["multi-user.target"]
    # a settings change reloads (SIGHUP) rather than restarts
    assert unit["reloadTriggers"] == [basic["etc"]["mdclaw/config.yaml"]]


def test_unit_hardening(basic: dict) -> None:
    sc = basic["unit"]["serviceConfig"]
    expected = {
        "ProtectSystem": "strict", "ProtectHome": True, "NoNewPrivileges": True,
        "PrivateDevices": True, "ProtectKernelTunables": True, "ProtectKernelModules": True,
        "ProtectKernelLogs": True, "ProtectControlGroups": True, "ProtectClock": True,
        "ProtectHostname": True, "RestrictNamespaces": True, "RestrictRealtime": True,
        "RestrictSUIDSGID": True, "LockPersonality": True, "CapabilityBoundingSet": "",
        "SystemCallArchitectures": "native", "User": "mdclaw", "Group": "mdclaw",
    }
    assert {k: sc.get(k) for k in expected} == expected
    assert sc["RestrictAddressFamilies"] == ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"]
    assert sc["SystemCallFilter"][0] == "@system-service"
    # the engine resolves bind mounts in its own namespace: data must not be in a private /tmp
    assert sc["PrivateTmp"] is False
    assert sc["StateDirectory"] == ["mdclaw"] and sc["WorkingDirectory"] == "/var/lib/mdclaw"
    # ...and /tmp is read-only there, so temporary files go to the runtime directory
    assert sc["RuntimeDirectory"] == "mdclaw"
    assert basic["unit"]["environment"]["TMPDIR"] == "/run/mdclaw"


def test_static_user_and_group(basic: dict) -> None:
    assert basic["users"]["mdclaw"]["isSystemUser"] is True
    assert basic["users"]["mdclaw"]["group"] == "mdclaw"
    assert "mdclaw" in basic["groups"]


def test_credentials_are_loaded_not_copied(basic: dict) -> None:
    sc = basic["unit"]["serviceConfig"]
    assert sc["LoadCredential"] == ["anthropic:/run/secrets/anthropic"]
    assert basic["settings"]["models"]["claude"]["api_key_file"] == \
        "$CREDENTIALS_DIRECTORY/anthropic"
    assert "/run/secrets/anthropic" not in json.dumps(basic["settings"])


def test_podman_engine_wiring_and_image_load(basic: dict) -> None:
    sc = basic["unit"]["serviceConfig"]
    # mdclaw uses Podman's own socket: /run/docker.sock is left alone (dockerd may run too)
    assert basic["podman"]["enable"] is True
    assert basic["podman"]["dockerSocket"] == {"enable": False}
    assert sc["SupplementaryGroups"] == ["podman"] and "podman" in basic["groups"]
    assert "podman.socket" in basic["unit"]["requires"]
    assert basic["settings"]["runtime"] == {
        "engine": "podman", "socket": "unix:///run/podman/podman.sock",
        "image": "mdclaw-agent:c1a0de00"}  # a claude model: the Claude image's tag
    assert "ExecStartPre" not in sc
    # the image is loaded by its own unit, before the daemon, with its own (long) timeout
    img = basic["imageUnit"]
    isc = img["serviceConfig"]
    assert isc["ExecStart"].endswith("-mdclaw-agent.tar.gz")
    assert "/bin/mdclaw image load /nix/store/" in isc["ExecStart"]
    assert isc["Type"] == "oneshot" and isc["RemainAfterExit"] is True
    assert isc["TimeoutStartSec"] == "15min" and isc["User"] == "mdclaw"
    assert img["requiredBy"] == ["mdclaw.service"] and img["before"] == ["mdclaw.service"]
    assert "mdclaw-image.service" in basic["unit"]["requires"]
    assert "mdclaw-image.service" in basic["unit"]["after"]
    # restart to READY=1 with the image loaded: ~6 s measured (docs/performance.md)
    assert sc["TimeoutStartSec"] == "90s"


def test_docker_engine(lib: Path, tmp_path: Path) -> None:
    r = eval_module(lib, tmp_path, module('containerEngine = "docker"; ' + MAIN))
    sc = r["unit"]["serviceConfig"]
    assert r["docker"]["enable"] is True and r["podman"]["enable"] is False
    assert "docker" in r["groups"]
    assert sc["SupplementaryGroups"] == ["docker"]
    assert r["unit"]["requires"] == ["docker.service", "mdclaw-image.service"]
    assert r["settings"]["runtime"]["engine"] == "docker"
    assert r["settings"]["runtime"]["socket"] == "unix:///run/docker.sock"


def test_custom_data_dir_and_home_mounts(lib: Path, tmp_path: Path) -> None:
    r = eval_module(lib, tmp_path, module(MAIN + """
      settings.data_dir = "/srv/mdclaw";
      settings.mount_policy.allowed_roots = [ { path = "/home/alice/projects"; } ];
    """))
    sc = r["unit"]["serviceConfig"]
    assert sc["ReadWritePaths"] == ["/srv/mdclaw"] and sc["StateDirectory"] == []
    assert r["tmpfiles"] == ["d '/srv/mdclaw' 0750 mdclaw mdclaw - -"]
    assert sc["ProtectHome"] == "read-only"  # mdclaw must see the mount roots it checks


def test_without_image(lib: Path, tmp_path: Path) -> None:
    r = eval_module(lib, tmp_path, module(
        MAIN + ' image = null; settings.runtime.image = "localhost/mdclaw-agent:dev";'))
    assert r["imageUnit"] is None
    assert "mdclaw-image.service" not in r["unit"]["requires"]
    assert r["settings"]["runtime"]["image"] == "localhost/mdclaw-agent:dev"
    r = eval_module_raw(lib, tmp_path, module(MAIN + " image = null;"))
    assert r.returncode != 0 and "settings.runtime.image" in r.stderr


def test_disabled_module_adds_nothing(lib: Path, tmp_path: Path) -> None:
    r = eval_module(lib, tmp_path, "{ services.mdclaw.settings.log_level = \"debug\"; }")
    assert r["enabled"] is False and r["unit"] is None and r["users"] == {}


# --------------------------------------------------------------------------- the config file

def test_unset_keys_are_left_to_mdclaw(basic: dict) -> None:
    s = basic["settings"]
    assert s["limits"] == {"max_concurrent_containers": 3, "container_timeout": "1h", "cpus": 1.5}
    assert s["groups"]["main"] == {"name": "Admin", "jid": "hl:main", "main": True,
                                   "requires_trigger": False}
    assert "mount_policy" not in s and "log_level" not in s
    assert s["data_dir"] == "/var/lib/mdclaw"


def test_rendered_config_passes_check_config(basic: dict, cli, tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(basic["settings"]))  # JSON is YAML, as pkgs.formats.yaml's
    r = cli("check-config", "--skip-secrets", "--config", str(path))
    assert r.returncode == 0, r.stderr
    assert "config ok: 2 group(s), main: main, 1 task(s)" in r.stdout
    # outside the service the credential is "set in the service's credentials": accepted
    assert cli("check-config", "--config", str(path)).returncode == 0
    # inside it (CREDENTIALS_DIRECTORY set) a missing credential is an error
    creds = tmp_path / "creds"
    creds.mkdir()
    r = cli("check-config", "--config", str(path), env={"CREDENTIALS_DIRECTORY": str(creds)})
    assert r.returncode == 1 and "api_key_file" in r.stderr


def test_config_is_validated_at_build_time(basic: dict) -> None:
    built = basic["configFile"]
    assert "mdclaw check-config --skip-secrets --skip-host-checks --config config.yaml" in \
        built["script"]
    assert built["env"]["nativeBuildInputs"][0].endswith("-mdclaw-0.1.0")
    assert "zoneinfo" in built["env"]["PYTHONTZPATH"]
    assert basic["etc"]["mdclaw/config.yaml"].endswith("-mdclaw-config.yaml")


def test_check_config_can_be_turned_off(lib: Path, tmp_path: Path) -> None:
    r = eval_module(lib, tmp_path, module(MAIN + " checkConfig = false;"))
    assert r["configFile"]["script"] is None


# --------------------------------------------------------------------------- mistakes

BAD = [
    ("misspelt key", 'settings.groups.main = { name = "A"; jid = "hl:main"; main = true; tigger = "@x"; };',
     "tigger' does not exist"),
    ("unknown section", MAIN + ' settings.limit.cpus = 1;', "settings.limit' does not exist"),
    ("wrong type", 'settings.groups.main = { name = "A"; jid = "hl:main"; main = "yes"; };',
     "main' is not of type `null or boolean'"),
    ("out of range", MAIN + " settings.limits.max_concurrent_containers = 0;",
     "max_concurrent_containers' is not of type"),
    ("bad enum", MAIN + ' settings.models.m = { backend = "gpt"; model = "x"; };',
     "backend' is not of type `one of \"claude\", \"openai\"'"),
    ("pattern", MAIN + ' settings.server.listen = "everywhere";', "listen' is not of type"),
    ("old name's pattern", MAIN + ' settings.channels.http.listen = "everywhere";',
     "listen' is not of type"),
    ("url pattern", MAIN + ' settings.models.m = { backend = "openai"; model = "x"; base_url = "ftp://x"; };',
     "base_url' is not of type"),
    ("bad duration", MAIN + ' settings.limits.idle_timeout = "ten minutes";', "idle_timeout' is not of type"),
    ("empty name", 'settings.groups.main = { name = ""; jid = "hl:main"; main = true; };',
     "name' is not of type"),
    ("missing required", 'settings.groups.main = { jid = "hl:main"; main = true; };',
     "settings.groups.main.name'"),
    ("secret in the store", MAIN + ' settings.channels.telegram.token_file = "/nix/store/abc-token";',
     "token_file' is not of type"),
    ("secret as a Nix path", MAIN + " settings.channels.telegram.token_file = ./token;",
     "token_file' is not of type"),
    ("credential in the store", MAIN + ' credentials.x = "/nix/store/abc-key";', "credentials.x' is not of type"),
    ("credential name", MAIN + ' credentials."a/b" = "/run/secrets/x";', "credentials: names may hold only"),
    ("two main groups", 'settings.groups = { a = { name = "A"; jid = "hl:a"; main = true; }; '
     'b = { name = "B"; jid = "hl:b"; main = true; }; };', "exactly one group must have main = true; found 2"),
    ("no main group", 'settings.groups.a = { name = "A"; jid = "hl:a"; };', "found 0"),
    ("reserved folder", 'settings.groups.global = { name = "G"; jid = "hl:g"; main = true; };',
     "group names are folder names"),
    ("bad folder", 'settings.groups."my group" = { name = "G"; jid = "hl:g"; main = true; };',
     "got my group"),
    ("unknown model", MAIN + ' settings.assistant.model = "gpt";',
     'assistant.model = "gpt" is not in settings.models'),
    ("engine mismatch", MAIN + ' settings.runtime.engine = "docker";', "set containerEngine instead"),
    ("unknown engine", MAIN + ' containerEngine = "lxc";', "containerEngine' is not of type"),
]


@pytest.mark.parametrize("body,message", [(b, m) for _, b, m in BAD], ids=[n for n, _, _ in BAD])
def test_mistakes_fail_evaluation(lib: Path, tmp_path: Path, body: str, message: str) -> None:
    r = eval_module_raw(lib, tmp_path, module(body))
    assert r.returncode != 0, f"evaluation should fail for: {body}"
    assert message in r.stderr, r.stderr[-2000:]


def test_a_good_config_of_every_kind_evaluates(lib: Path, tmp_path: Path, cli) -> None:
    r = eval_module(lib, tmp_path, module("""
      credentials.tg = "/run/secrets/tg";
      settings = {
        log_level = "debug";
        assistant.name = "Bob";
        groups.main = { name = "Admin"; jid = "tg:1"; main = true; network = "bridge";
                        mounts = [ { host = "/srv/notes"; container = "notes"; readonly = false; } ];
                        allow_senders = { mode = "drop"; ids = [ "111" ]; }; };
        mount_policy = { allowed_roots = [ { path = "/srv"; allow_read_write = true; description = "data"; } ];
                         blocked_patterns = [ "secret" ]; non_main_read_only = true; };
        channels.telegram = { token_file = "$CREDENTIALS_DIRECTORY/tg"; api_base = "http://127.0.0.1:8081"; };
        channels.http = { enabled = false; secret_file = "/run/credentials/mdclaw.service/web"; };
        limits = { idle_timeout = 60000; ipc_poll_interval = "500ms"; memory = "1g"; pids = 256; };
        runtime = { install_id = "home-1"; allowed_networks = [ "bridge" ]; };
        tasks = [ { id = "t1"; group = "main"; prompt = "p"; interval = "1h"; context_mode = "group"; }
                  { id = "t2"; group = "main"; prompt = "p"; once = "2030-01-01T08:00:00"; timezone = "UTC"; catch_up = false; } ];
      };
    """))
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(r["settings"]))
    # as at build time: the mount's host path and the secrets exist only on the server
    res = cli("check-config", "--skip-secrets", "--skip-host-checks", "--config", str(path))
    assert res.returncode == 0, res.stderr
    assert r["settings"]["groups"]["main"]["allow_senders"] == {"mode": "drop", "ids": ["111"]}


# --------------------------------------------------------------------------- descriptions

def _schema_descriptions() -> dict[str, str]:
    """Option path under settings (as the NixOS manual names it) -> the schema's description."""
    schema = config_json_schema()
    out: dict[str, str] = {}

    def walk(node: dict, prefix: str) -> None:
        if "$ref" in node:
            node = schema["$defs"][node["$ref"].rsplit("/", 1)[-1]]
        for key, prop in node.get("properties", {}).items():
            path = f"{prefix}{key}"
            out[path] = prop.get("description", "")
            for alt in [prop, *prop.get("anyOf", ())]:
                if "$ref" in alt:
                    walk(alt, f"{path}.")
                if isinstance(alt.get("additionalProperties"), dict):
                    walk(alt["additionalProperties"], f"{path}.<name>.")
                if "$ref" in alt.get("items", {}):
                    walk(alt["items"], f"{path}.*.")

    walk(schema, "")
    return out


def test_option_descriptions_come_from_the_schema(basic: dict) -> None:
    options = basic["options"]
    expected = _schema_descriptions()
    assert set(options) == set(expected), "every config key is an option, and nothing else"
    for path, description in expected.items():
        assert options[path]["description"].startswith(description), path
    assert "When unset (null), mdclaw uses `5`" in \
        options["limits.max_concurrent_containers"]["description"]


# --------------------------------------------------------------------------- the docs

def _doc_blocks() -> list[str]:
    import re

    from nixeval import REPO

    text = (REPO / "docs" / "nixos.md").read_text()
    return re.findall(r"```nix\n(.*?)```", text, flags=re.S)


def test_documented_configuration_evaluates_and_passes_check_config(
        lib: Path, tmp_path: Path, cli) -> None:
    [example] = [b for b in _doc_blocks() if "services.mdclaw = {" in b and "telegram" in b]
    r = eval_module(lib, tmp_path, example, allow_claude_code=True)
    assert r["unit"]["serviceConfig"]["LoadCredential"] == [
        "anthropic:/run/secrets/anthropic-api-key", "telegram:/run/secrets/telegram-bot-token"]
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(r["settings"]))
    res = cli("check-config", "--skip-secrets", "--skip-host-checks", "--config", str(path))
    assert res.returncode == 0, res.stderr
    assert "config ok: 3 group(s), main: main, 1 task(s)" in res.stdout


def test_documented_first_setup_evaluates(lib: Path, tmp_path: Path, cli) -> None:
    """The step-by-step block: a local model, no unfree package, alice in the mdclaw group
    (her account exists elsewhere in a real configuration)."""
    [first] = [b for b in _doc_blocks() if "services.mdclaw = {" in b and "telegram" not in b]
    r = eval_module(lib, tmp_path, "{ imports = [ (" + first + ") ]; "
                    "users.users.alice.isNormalUser = true; }")
    assert r["settings"]["runtime"]["image"] == "mdclaw-agent:0123abcd"  # the free image
    assert r["users"]["alice"]["extraGroups"] == ["mdclaw"]
    assert r["unit"]["serviceConfig"]["LoadCredential"] == ["model-key:/run/secrets/model-key"]
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(r["settings"]))
    res = cli("check-config", "--config", str(path))  # the credential: the service's
    assert res.returncode == 0, res.stderr


def test_documented_overlay_route_names_the_predicate() -> None:
    from nixeval import REPO

    text = (REPO / "docs" / "nixos.md").read_text()
    assert 'nixpkgs.config.allowUnfreePredicate = pkg: builtins.elem (lib.getName pkg) ' \
        '[ "claude-code" ];' in text
    module = (REPO / "nixos-module" / "default.nix").read_text()
    assert "nixpkgs.config.allowUnfreePredicate = pkg: builtins.elem (lib.getName pkg) " \
        '[ \\"claude-code\\" ];' in module


# --------------------------------------------------------------------------- backup

def test_no_backup_unless_enabled(basic: dict) -> None:
    assert basic["backupUnit"] is None and basic["backupTimer"] is None


def test_backup_timer_and_oneshot(lib: Path, tmp_path: Path) -> None:
    r = eval_module(lib, tmp_path, module(MAIN + """
      backup = { enable = true; startAt = "weekly"; directory = "/srv/backups/mdclaw";
                 keep = 5; ageRecipientFile = "/etc/mdclaw/recipients.txt"; };
    """))
    unit, timer = r["backupUnit"], r["backupTimer"]
    sc = unit["serviceConfig"]
    assert sc["Type"] == "oneshot" and sc["User"] == "mdclaw"
    args = sc["ExecStart"].split()
    assert args[1:] == ["backup", "--config", "/etc/mdclaw/config.yaml", "--to",
                        "/srv/backups/mdclaw", "--keep", "5", "--age-recipients",
                        "/etc/mdclaw/recipients.txt", "--every", "7d"]
    assert args[0].endswith("/bin/mdclaw")
    assert sorted(sc["ReadWritePaths"]) == ["/srv/backups/mdclaw", "/var/lib/mdclaw"]
    assert sc["ProtectSystem"] == "strict" and sc["NoNewPrivileges"] is True
    assert timer["wantedBy"] == ["timers.target"]
    assert timer["timerConfig"]["OnCalendar"] == "weekly"
    assert timer["timerConfig"]["Persistent"] is True
    assert "d '/srv/backups/mdclaw' 0700 mdclaw mdclaw - -" in r["tmpfiles"]


def test_backup_defaults_and_a_calendar_without_a_known_period(lib: Path,
                                                                tmp_path: Path) -> None:
    r = eval_module(lib, tmp_path, module(MAIN + " backup.enable = true;"))
    args = r["backupUnit"]["serviceConfig"]["ExecStart"].split()
    assert args[args.index("--to") + 1] == "/var/backup/mdclaw"
    assert args[args.index("--keep") + 1] == "14" and args[args.index("--every") + 1] == "1d"
    assert "--age-recipients" not in args
    assert r["backupTimer"]["timerConfig"]["OnCalendar"] == "daily"
    r = eval_module(lib, tmp_path, module(MAIN + """
      backup = { enable = true; startAt = "*-*-* 03:30:00"; };"""))
    assert "--every" not in r["backupUnit"]["serviceConfig"]["ExecStart"]
    r = eval_module(lib, tmp_path, module(MAIN + """
      backup = { enable = true; startAt = "*-*-* 03,15:00:00"; expectEvery = "12h"; };"""))
    assert "--every 12h" in r["backupUnit"]["serviceConfig"]["ExecStart"]
    r = eval_module_raw(lib, tmp_path, module(MAIN + " backup = { enable = true; keep = 0; };"))
    assert r.returncode != 0 and "keep" in r.stderr
# --------------------------------------------------------------------------- MCP servers

MCP = """
{
  services.mdclaw = {
    enable = true;
    settings = {
      groups.main = { name = "Admin"; jid = "hl:main"; main = true; mcp = { git = [ "git_status" ]; }; };
      mcp_servers.git.timeout = "30s";
    };
    mcpServers.git = {
      command = "/nix/store/0000000000000000000000000000000a-mcp-server-git/bin/mcp-server-git";
      args = [ "--repository" "/srv/notes dir" ];
      credentials.GITHUB_TOKEN = "/run/secrets/gh";
      readWritePaths = [ "/srv/notes dir" ];
      user = "notes";
    };
    mcpServers.time.command = "mcp-server-time";
  };
}
"""


def test_each_mcp_server_is_a_socket_activated_sandboxed_service(lib: Path, tmp_path) -> None:
    r = eval_module(lib, tmp_path, MCP)
    # The daemon is pointed at each socket; the other keys stay the user's.
    assert r["settings"]["mcp_servers"] == {
        "git": {"socket": "/run/mdclaw-mcp/git.sock", "timeout": "30s"},
        "time": {"socket": "/run/mdclaw-mcp/time.sock"}}
    sock = r["mcpSockets"]["mdclaw-mcp-git"]
    assert sock["listenStreams"] == ["/run/mdclaw-mcp/git.sock"]
    assert sock["wantedBy"] == ["sockets.target"]
    # Accept=yes: each connection is a server instance's stdin and stdout; only mdclaw
    # may connect.
    assert {"Accept": True, "SocketUser": "mdclaw", "SocketMode": "0600"}.items() <= \
        sock["socketConfig"].items()
    git = r["mcpUnits"]["mdclaw-mcp-git@"]["serviceConfig"]
    assert git["StandardInput"] == "socket" and git["StandardOutput"] == "socket"
    assert git["User"] == "notes" and "DynamicUser" not in git
    assert git["PrivateNetwork"] is True and git["RestrictAddressFamilies"] == ["AF_UNIX"]
    assert git["ProtectSystem"] == "strict" and git["NoNewPrivileges"] is True
    assert git["CapabilityBoundingSet"] == ""
    assert git["ReadWritePaths"] == ["/srv/notes dir"]
    assert git["LoadCredential"] == ["GITHUB_TOKEN:/run/secrets/gh"]
    assert git["ExecStart"].endswith("-mdclaw-mcp-git")
    time_unit = r["mcpUnits"]["mdclaw-mcp-time@"]["serviceConfig"]
    assert time_unit["DynamicUser"] is True  # a user of its own by default
    unit = r["unit"]
    assert "mdclaw-mcp-git.socket" in unit["wants"] and "mdclaw-mcp-time.socket" in \
        unit["after"]
    # The secret path never reaches the rendered config.
    assert "/run/secrets/gh" not in json.dumps(r["settings"])


@pytest.mark.parametrize("body, words", [
    ('mcpServers."Bad__Name".command = "x";', "names are MCP server names"),
    ('mcpServers.git.command = "x"; settings.mcp_servers.git.command = "y";',
     "leave settings.mcp_servers.<name>.command and .url unset"),
    ('mcpServers.git = { command = "x"; credentials."A-B" = "/run/s"; };',
     "environment variable names"),
    ('mcpServers.git = { command = "x"; credentials.A = "/nix/store/abc-secret"; };',
     "absolute path outside the Nix store"),
])
def test_mcp_server_mistakes_fail_at_evaluation(lib: Path, tmp_path, body: str,
                                                words: str) -> None:
    r = eval_module_raw(lib, tmp_path, module(MAIN + body))
    assert r.returncode != 0 and words in r.stderr, r.stderr[-2000:]


def test_mcp_secret_maps_must_not_be_in_the_store(lib: Path, tmp_path) -> None:
    r = eval_module_raw(lib, tmp_path, module(MAIN + 'settings.mcp_servers.gh = { command = "x"; '
                                              'env_files.TOKEN = "/nix/store/abc-token"; };'))
    assert r.returncode != 0
    assert "secret files must not be in the Nix store" in r.stderr
    assert "mcp_servers.gh.env_files.TOKEN" in r.stderr
