"""The daemon's web server, made from the config's `server:` section: the one token gate
(shared with the /metrics listener of `metrics.listen`) and the server the local HTTP chat,
the operator page and /metrics join (mdclaw.webserver)."""

from __future__ import annotations

from mdclaw.config import Config, ensure_http_secret, read_secret
from mdclaw.errors import ConfigProblem
from mdclaw.webserver import TokenGate, WebServer, connection_limits


class WebServerSetupError(ConfigProblem):
    """The web server's token cannot be made or read: the daemon does not start (it would
    otherwise serve the chat without the token the config asks for)."""


def server_gate(cfg: Config) -> TokenGate:
    """The web server's token as a door: `server.secret_file`, or the generated token
    (written now on the first start); no token: loopback clients only, where it matters.
    Raises WebServerSetupError naming the file (never its content)."""
    server = cfg.web_server
    if server is None:
        return TokenGate(None)
    try:
        path = ensure_http_secret(cfg)
    except OSError as e:
        raise WebServerSetupError(f"cannot generate the web server's token in {cfg.data_dir} "
                                  f"(server.generate_secret): {e.strerror or e}") from None
    if path is None:
        return TokenGate(None)
    try:
        secret = read_secret(path)
    except OSError as e:
        raise WebServerSetupError(f"cannot read the web server's token {path} "
                                  f"(server.secret_file): {e.strerror or e}") from None
    if not secret:
        raise WebServerSetupError(f"the web server's token file {path} (server.secret_file) "
                                  "is empty")
    return TokenGate(secret)


def build_web_server(cfg: Config, gate: TokenGate) -> WebServer | None:
    """The web server on `server.listen` guarded by `gate`, not listening yet (None for
    `server: null`), its connections held to `server:`'s limits (mdclaw.listener)."""
    server = cfg.web_server
    return (WebServer(server.listen, gate, connection_limits(cfg)) if server is not None
            else None)
