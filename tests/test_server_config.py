"""`server:`, the daemon's web server, and the old names of its keys under `channels.http`:
read as the new ones with a check-config warning naming the new key; both set differently
(or the old one beside `server: null`) is an error naming both keys; `server: null` is no web
server, which the local chat cannot do without."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mdclaw.config import ConfigError, http_secret_path, iter_secret_files, load_config

HEAD = "data_dir: {data_dir}\ngroups: {{main: {{name: A, jid: 'hl:main', main: true}}}}\n"


def load(tmp_path: Path, body: str):  # noqa: ANN201
    return load_config(tmp_path / "c.yaml", text=HEAD.format(data_dir=tmp_path) + body)


def problems(tmp_path: Path, body: str) -> list[tuple[str, str, int | None]]:
    with pytest.raises(ConfigError) as e:
        load(tmp_path, body)
    return [(i.path, i.message, i.line) for i in e.value.issues]


def secret(tmp_path: Path, name: str = "token") -> Path:
    f = tmp_path / name
    f.write_text("s3cret\n")
    f.chmod(0o600)
    return f


def test_defaults_and_the_new_keys(tmp_path: Path) -> None:
    server = load(tmp_path, "").web_server
    assert server is not None
    assert (server.listen, server.secret_file, server.generate_secret) == (
        "127.0.0.1:3000", None, False)
    tok = secret(tmp_path)
    cfg = load(tmp_path, f"server: {{listen: ':8080', secret_file: {tok}}}\n")
    assert cfg.web_server is not None and cfg.web_server.listen == ":8080"
    assert http_secret_path(cfg) == tok
    assert list(iter_secret_files(cfg)) == [("server.secret_file", tok)]


def test_the_old_names_are_read_as_the_new_ones(tmp_path: Path) -> None:
    tok = secret(tmp_path)
    cfg = load(tmp_path, f"channels: {{http: {{listen: '127.0.0.1:4000', secret_file: {tok}, "
                         "generate_secret: true}}\n")
    server = cfg.web_server
    assert server is not None
    assert (server.listen, server.secret_file, server.generate_secret) == (
        "127.0.0.1:4000", tok, True)
    assert http_secret_path(cfg) == tok
    # the secret is checked (and shown) once, under the name it was given
    assert list(iter_secret_files(cfg)) == [("channels.http.secret_file", tok)]
    # a key `server` sets wins over nothing: the others still come from the old names
    cfg = load(tmp_path, "server: {generate_secret: true}\n"
                         "channels: {http: {listen: '127.0.0.1:4000'}}\n")
    assert cfg.web_server is not None
    assert (cfg.web_server.listen, cfg.web_server.generate_secret) == ("127.0.0.1:4000", True)
    assert http_secret_path(cfg) == tmp_path / "http-secret"


def test_both_names_with_different_values_is_an_error_naming_both(tmp_path: Path) -> None:
    got = problems(tmp_path, "server: {listen: '127.0.0.1:4001'}\n"
                             "channels:\n  http:\n    listen: '127.0.0.1:4000'\n")
    assert len(got) == 1
    path, message, line = got[0]
    assert path == "channels.http.listen" and line == 6  # at the old key's line
    assert "server.listen" in message and "channels.http.listen" in message
    assert "127.0.0.1:4000" in message and "127.0.0.1:4001" in message
    # the same value under both names is fine (a warning says which to keep)
    cfg = load(tmp_path, "server: {listen: '127.0.0.1:4000'}\n"
                         "channels: {http: {listen: '127.0.0.1:4000'}}\n")
    assert cfg.web_server is not None and cfg.web_server.listen == "127.0.0.1:4000"


def test_no_web_server(tmp_path: Path) -> None:
    cfg = load(tmp_path, "server: null\nchannels: {http: null}\n")
    assert cfg.web_server is None and http_secret_path(cfg) is None
    assert load(tmp_path, "server: null\nchannels: {http: {enabled: false}}\n"
                ).web_server is None
    # the chat needs the server
    [(path, message, _)] = problems(tmp_path, "server: null\n")
    assert path == "channels.http" and "server is null" in message
    # an old name beside `server: null` says which two keys disagree
    got = problems(tmp_path, "server: null\n"
                             "channels: {http: {enabled: false, listen: ':4000'}}\n")
    assert [p for p, _, _ in got] == ["channels.http.listen"]
    assert "server is null" in got[0][1] and "server.listen" in got[0][1]


def test_check_config_warns_naming_the_new_key(cli, write_config) -> None:
    path = write_config("data_dir: {data_dir}\nchannels:\n  http:\n"
                        "    listen: '127.0.0.1:4000'\n    generate_secret: true\n")
    r = cli("check-config", "--config", str(path))
    assert r.returncode == 0, r.stderr
    assert "1 warning" not in r.stderr and "2 warnings" in r.stderr
    assert ":4: warning: channels.http.listen:" in r.stderr and "server.listen" in r.stderr
    assert "channels.http.generate_secret:" in r.stderr and "server.generate_secret" in r.stderr
    found = json.loads(cli("check-config", "--json", "--config", str(path)).stdout)
    assert {(i["path"], i["severity"]) for i in found} == {
        ("channels.http.listen", "warning"), ("channels.http.generate_secret", "warning")}
    # the new keys: no warning
    path = write_config("data_dir: {data_dir}\nserver: {listen: '127.0.0.1:4000'}\n")
    r = cli("check-config", "--config", str(path))
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    # and an environment variable sets the new key like any other
    r = cli("check-config", "--json", "--config", str(path),
            env={"MDCLAW_SERVER__LISTEN": "nowhere"})
    assert r.returncode == 1 and "server.listen" in r.stdout


def test_environment_overrides_reach_the_server(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(os.environ, "MDCLAW_SERVER__LISTEN", "127.0.0.1:4555")
    cfg = load(tmp_path, "")
    assert cfg.web_server is not None and cfg.web_server.listen == "127.0.0.1:4555"
