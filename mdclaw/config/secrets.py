"""Secret files: where the config names them, the one pass that checks them, reading them.

Secrets are never written in the config: keys ending in `_file` name a file that holds them
(the schema only expands the path: mdclaw.config.types.SecretFile). `secret_file_issues` is
the one place the files themselves are looked at: each must exist, be a regular file, not be
readable by every user and be readable by this one. `mdclaw check-config` (unless
`--skip-secrets`), `mdclaw doctor` and the daemon (at start and on every reload) call it; a
secret in the service's credentials ($CREDENTIALS_DIRECTORY, seen from outside the service)
is checked where it exists, inside the service. A secret is read only when needed
(`read_secret`) and never logged; the operator page shows each as "set" or "missing".
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel

from mdclaw.config.load import ConfigError, ConfigIssue, file_key_lines, find_config_path, issue_at
from mdclaw.config.schema import Config
from mdclaw.config.types import CREDENTIALS_VAR, SecretFile, in_service_credentials
from mdclaw.errors import ConfigProblem


class ServiceCredential(ConfigProblem, OSError):
    """A secret that only the service can read (see in_service_credentials)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(f"{path} is set in the service's credentials: {CREDENTIALS_VAR} "
                         "exists only inside the mdclaw service; run the command as root "
                         "(`sudo mdclaw ...` runs it as the service, with its credentials)")
        self.strerror = "set in the service's credentials"
        self.filename = str(path)


def read_secret(path: Path) -> str:
    """Return the secret held in `path`, stripped of surrounding whitespace.

    Raises OSError if the file went away; the message names the file, never the content.
    ServiceCredential (an OSError) when the file is in the service's credentials only.
    """
    if in_service_credentials(path):
        raise ServiceCredential(path)
    return Path(path).read_text(encoding="utf-8").strip()


# --------------------------------------------------------------------------- where they are

def _is_secret_field(model: type[BaseModel], name: str) -> bool:
    info = model.model_fields[name]
    secret_meta = get_args(SecretFile)[1:]
    return (any(m in secret_meta for m in info.metadata)
            or SecretFile in get_args(info.annotation))


def _walk(node: Any, path: tuple[str, ...]) -> Iterator[tuple[str, Path]]:
    if isinstance(node, BaseModel):
        for name in type(node).model_fields:
            value = getattr(node, name)
            if _is_secret_field(type(node), name):
                if isinstance(value, Mapping):  # NAME: file (mcp_servers.<s>.env_files)
                    for key, item in value.items():
                        yield ".".join(path + (name, str(key))), item
                elif isinstance(value, tuple):  # [file, ...] (channels.telegram.pool_token_files)
                    for n, item in enumerate(value):
                        yield ".".join(path + (name, str(n))), item
                elif value is not None:
                    yield ".".join(path + (name,)), value
            else:
                yield from _walk(value, path + (name,))
    elif isinstance(node, Mapping):
        for key, value in node.items():
            yield from _walk(value, path + (str(key),))
    elif isinstance(node, tuple):
        for n, value in enumerate(node):
            yield from _walk(value, path + (str(n),))


def iter_secret_files(cfg: Config) -> Iterator[tuple[str, Path]]:
    """Every configured secret file as (config key path, file path), in the config's order:
    every field of the schema typed SecretFile that is set."""
    yield from _walk(cfg, ())


def service_credential_secrets(cfg: Config) -> list[tuple[str, Path]]:
    """The secret files this process cannot read because they are in the service's
    credentials ($CREDENTIALS_DIRECTORY is unset here), as (config key path, file path)."""
    return [(k, p) for k, p in iter_secret_files(cfg) if in_service_credentials(p)]


# --------------------------------------------------------------------------- the check

def secret_file_problem(path: Path) -> str | None:
    """What is wrong with the secret file at `path` (with the fix where there is one), or
    None: it must exist, be a regular file, not be readable by everyone and be readable by
    this user. A file in the service's credentials, seen from outside, is not looked at."""
    if in_service_credentials(path):
        return None  # checked where it exists: inside the service
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"secret file {str(path)!r} does not exist"
    except PermissionError:
        return f"secret file {str(path)!r} cannot be read by this user"
    except OSError as e:
        return f"secret file {str(path)!r} cannot be read: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode):
        return f"secret file {str(path)!r} is not a regular file"
    if st.st_mode & stat.S_IROTH:
        return (f"secret file {str(path)!r} is readable by every user (mode "
                f"{stat.S_IMODE(st.st_mode):04o}); run: chmod o-rwx {path}")
    if not os.access(path, os.R_OK):
        return f"secret file {str(path)!r} cannot be read by this user"
    return None


def secret_file_issues(cfg: Config, lines: Mapping[tuple[str, ...], int] | None = None,
                       ) -> list[ConfigIssue]:
    """Every problem with the config's secret files, each at its key (at its line, given the
    file's `lines`: key_lines / file_key_lines)."""
    found = []
    for key, path in iter_secret_files(cfg):
        problem = secret_file_problem(path)
        if problem is not None:
            found.append(issue_at(tuple(key.split(".")), problem, dict(lines or {})))
    return found


def check_secret_files(cfg: Config, config_path: str | os.PathLike[str] | None = None) -> None:
    """Raise ConfigError (the config file's name, every secret problem at its line) when a
    secret file of `cfg`, read from `config_path`, is not as it must be."""
    issues = secret_file_issues(cfg)
    if issues:
        issues = secret_file_issues(cfg, file_key_lines(config_path))
        raise ConfigError(str(find_config_path(config_path)), issues)


# --------------------------------------------------------------------------- shown, generated

def secret_state(path: Path) -> str:
    """"set" when the secret file can be read and holds something, else "missing". The
    secret itself is read only to tell, never returned."""
    try:
        return "set" if read_secret(path) else "missing"
    except (OSError, UnicodeDecodeError):
        return "missing"


def config_for_display(cfg: Config) -> dict[str, Any]:
    """The config as JSON, each secret file shown as "set" or "missing" (never its path's
    content); for the operator page."""
    out: dict[str, Any] = cfg.model_dump(mode="json")
    for key, path in iter_secret_files(cfg):
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node[p]
        node[last] = secret_state(path)
    return out


def config_text_for_display(cfg: Config, path: Path | str, limit: int = 256 * 1024
                            ) -> str | None:
    """The config file at `path` as the operator wrote it, for the operator page: each line
    naming one of `cfg`'s secret files marked `# set` or `# missing` (every secret is a
    `*_file` key, so the file holds paths, never secret values); None when it cannot be
    read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(limit)
    except OSError:
        return None
    states = {str(p): secret_state(p) for _key, p in iter_secret_files(cfg)}
    out = []
    for line in text.splitlines():
        code = line.split(" #", 1)[0]
        named = [] if line.lstrip().startswith("#") else \
            [state for p, state in states.items() if p in code]
        out.append(f"{line}  # {', '.join(named)}" if named else line)
    return "\n".join(out) + "\n"


HTTP_SECRET_NAME = "http-secret"  # noqa: S105 - a file name, not a secret


def http_secret_path(cfg: Config) -> Path | None:
    """The web server's token file: `server.secret_file`, else the generated one in data_dir
    when `server.generate_secret` is on, else None (no token, or no web server)."""
    server = cfg.web_server
    if server is None:
        return None
    if server.secret_file is not None:
        return server.secret_file
    return cfg.data_dir / HTTP_SECRET_NAME if server.generate_secret else None


def ensure_http_secret(cfg: Config) -> Path | None:
    """http_secret_path(), generating the token first when it is to be generated and does
    not exist yet (a new random token, mode 0600, never replaced once written)."""
    path = http_secret_path(cfg)
    server = cfg.web_server
    if path is None or server is None or server.secret_file is not None:
        return path
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return path  # made on an earlier start (or by a racing one): keep it
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path
