"""A real Matrix homeserver for the tests: Synapse on loopback, SQLite, registration by shared
secret, no federation.

Synapse runs from a virtual environment of its own (`.ci/setup-synapse` builds it once into
the CI cache; `$MDCLAW_SYNAPSE_PYTHON` names its python). Without it the Matrix tests FAIL
under CI=true and are skipped elsewhere, with the command that installs it.

`Synapse(folder).start()` writes the config and a signing key, starts the homeserver and waits
until it answers; `stop()` ends it (SIGTERM); `start()` again takes up the same database, so a
test can take the homeserver away and bring it back. `register(name)` makes an account (the
shared-secret admin API) and returns its access token. Messages are rate limited as
`RC_MESSAGE` says (low, so the bot meets the homeserver's limit); `unlimited(user)` lifts
the limit for one account (the people the tests play).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

SERVER_NAME = "mdclaw.test"
CACHE = Path(os.environ.get("MDCLAW_CI_CACHE", "/var/cache/mdclaw-ci"))
VERSION = "1.163.2"  # as .ci/setup-synapse installs it
RC_MESSAGE = {"per_second": 1, "burst_count": 6}
MAX_UPLOAD = "2M"


def synapse_python() -> str:
    """The python of Synapse's own environment; fails under CI=true, skips elsewhere."""
    given = os.environ.get("MDCLAW_SYNAPSE_PYTHON")
    candidates = [Path(given)] if given else []
    candidates.append(CACHE / f"synapse-{VERSION}" / "bin" / "python")
    for c in candidates:
        if c.exists():
            return str(c)
    reason = (f"Synapse is not installed (looked for {', '.join(map(str, candidates))}); run "
              "`. .ci/setup-synapse`")
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but {reason}", pytrace=False)
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Synapse:
    """One homeserver in `folder` (its config, database, media and log)."""

    def __init__(self, folder: Path, python: str) -> None:
        self.folder = folder
        self.python = python
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.secret = secrets.token_hex(16)
        self.proc: subprocess.Popen[bytes] | None = None
        self.admin_token: str | None = None
        self._write_config()

    def _write_config(self) -> None:
        d = self.folder
        d.mkdir(parents=True, exist_ok=True)
        seed = base64.b64encode(secrets.token_bytes(32)).decode().rstrip("=")
        (d / "signing.key").write_text(f"ed25519 a_test {seed}\n")
        (d / "log.yaml").write_text(
            "version: 1\n"
            "formatters: {precise: {format: '%(asctime)s %(levelname)s %(name)s %(message)s'}}\n"
            f"handlers: {{file: {{class: logging.FileHandler, formatter: precise, "
            f"filename: {d}/homeserver.log}}}}\n"
            "root: {level: WARNING, handlers: [file]}\n"
            "disable_existing_loggers: false\n")
        config = {
            "server_name": SERVER_NAME,
            "pid_file": str(d / "homeserver.pid"),
            "listeners": [{"port": self.port, "bind_addresses": ["127.0.0.1"], "type": "http",
                           "tls": False, "resources": [{"names": ["client"],
                                                        "compress": False}]}],
            "database": {"name": "sqlite3", "args": {"database": str(d / "homeserver.db")}},
            "media_store_path": str(d / "media"),
            "max_upload_size": MAX_UPLOAD,
            "registration_shared_secret": self.secret,
            "report_stats": False,
            "macaroon_secret_key": secrets.token_hex(16),
            "form_secret": secrets.token_hex(16),
            "signing_key_path": str(d / "signing.key"),
            "log_config": str(d / "log.yaml"),
            "trusted_key_servers": [],
            "suppress_key_server_warning": True,
            "federation_domain_whitelist": [],
            "enable_registration": False,
            # Each sync the tests make asks the server anew (by default an identical one is
            # answered from a cache for two minutes: a person's "who is typing" would not
            # change).
            "caches": {"sync_response_cache_duration": 0},
            "rc_message": RC_MESSAGE,
            "rc_login": {k: {"per_second": 100, "burst_count": 100}
                         for k in ("address", "account", "failed_attempts")},
            "rc_joins": {"local": {"per_second": 100, "burst_count": 100}},
            "rc_invites": {k: {"per_second": 100, "burst_count": 100}
                           for k in ("per_room", "per_user", "per_issuer")},
        }
        (d / "homeserver.yaml").write_text(json.dumps(config))  # JSON is YAML

    def start(self, timeout: float = 60) -> None:
        assert self.proc is None
        log = open(self.folder / "stdout.log", "ab")  # noqa: SIM115 - the process keeps it
        self.proc = subprocess.Popen(
            [self.python, "-m", "synapse.app.homeserver", "-c",
             str(self.folder / "homeserver.yaml")],
            cwd=self.folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                out = (self.folder / "stdout.log").read_text(errors="replace")[-3000:]
                self.proc = None
                raise AssertionError(f"Synapse exited at start:\n{out}")
            try:
                with urllib.request.urlopen(f"{self.base}/_matrix/client/versions",
                                            timeout=1):
                    break
            except (OSError, urllib.error.URLError):
                if time.monotonic() > deadline:
                    raise AssertionError(f"Synapse did not answer within {timeout} s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    # ------------------------------------------------------------------ the API
    def request(self, method: str, path: str, body: Any = None,
                token: str | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.base}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"{}")

    def register(self, name: str, password: str | None = None, *,
                 admin: bool = False) -> dict[str, str]:
        """Make the account @name:mdclaw.test; its {user_id, access_token, device_id}."""
        password = password or secrets.token_hex(8)
        nonce = self.request("GET", "/_synapse/admin/v1/register")["nonce"]
        mac = hmac.new(self.secret.encode(), digestmod=hashlib.sha1)
        mac.update(b"\x00".join([nonce.encode(), name.encode(), password.encode(),
                                 b"admin" if admin else b"notadmin"]))
        return dict(self.request("POST", "/_synapse/admin/v1/register", {
            "nonce": nonce, "username": name, "password": password, "admin": admin,
            "mac": mac.hexdigest()}))

    def unlimited(self, user_id: str) -> None:
        """No message rate limit for `user_id` (the people the tests play)."""
        if self.admin_token is None:
            self.admin_token = self.register(f"admin{secrets.token_hex(3)}",
                                             admin=True)["access_token"]
        self.request("POST", f"/_synapse/admin/v1/users/{user_id}/override_ratelimit",
                     {"messages_per_second": 0, "burst_count": 0}, token=self.admin_token)
