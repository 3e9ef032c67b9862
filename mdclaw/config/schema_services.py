"""The services mdclaw talks to: model backends (`models`), chat `channels`, the files people
send (`media`) and their `transcription`, host `integrations` (Home Assistant), `web` access
for agents, the MCP servers the host runs for them (`mcp_servers`) and the Prometheus
`metrics` endpoint."""

from __future__ import annotations

import ipaddress
import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from mdclaw.config.types import (
    LISTEN_PATTERN,
    Cidr,
    CrossKeyError,
    Domain,
    Duration,
    Frozen,
    Glob,
    Problem,
    SecretFile,
    Size,
    parse_size,
    short_repr,
)


class ModelSpec(Frozen):
    backend: Literal["claude", "openai"] = Field(description="claude (Agent SDK) or openai.")
    model: str = Field(min_length=1, description="Model name passed to the backend.")
    base_url: str | None = Field(None, pattern=r"^https?://",
                                 description="API base URL (default: the provider's).")
    api_key_file: SecretFile | None = Field(None, description="File holding the API key.")
    allow_models: tuple[str, ...] = Field(
        (), description="Other model names an agent may ask for with this entry's key. The "
        "credential proxy sends every request with `model` set to this entry's `model`, "
        "unless the request names one of these (the claude CLI asks for a small model for "
        "side tasks, e.g. `claude-haiku-4-5`).")
    allow_server_tools: bool = Field(
        False, description="Let agents make the model API run tools or fetch URLs itself "
        "with this entry's key: Anthropic's server tools (web search and fetch, code "
        "execution, `mcp_servers`, `container`...), OpenAI's `web_search_options` and hosted "
        "tools, images and documents by URL. Off: the credential proxy refuses such a "
        "request with 403 `mdclaw_server_tools_refused` (they bypass the host's web rules "
        "and the container's lack of network); only tools the agent runs itself go.")


class Server(Frozen):
    listen: str = Field("127.0.0.1:3000", pattern=LISTEN_PATTERN,
                        description="host:port the daemon's web server listens on.")
    secret_file: SecretFile | None = Field(
        None, description="Bearer token file (optional): required by the chat's endpoints, "
        "the operator page and /metrics.")
    generate_secret: bool = Field(
        False, description="When `secret_file` is unset: generate a random token into "
        "`<data_dir>/http-secret` (mode 0600) on the daemon's first start and require it, so "
        "no other local user can post as the main group. `mdclaw send` and `mdclaw "
        "http-token` (for the chat page) read it. The NixOS module turns this on.")
    # Slow and greedy clients (mdclaw.listener); also for the /metrics listener.
    header_timeout: Duration = Field(
        timedelta(seconds=10), description="Longest a client may take to send a request's "
        "headers, counted from its first byte; a slower connection is closed (a "
        "\"slowloris\" client holds connections open by sending a byte now and then). Also "
        "the /metrics listener's.")
    body_timeout: Duration = Field(
        timedelta(seconds=30), description="Longest a request's body (an upload) may take, "
        "plus one second for every KiB that arrived: a slow but steady upload goes on, a "
        "trickle is closed. Also the /metrics listener's.")
    idle_timeout: Duration = Field(
        timedelta(seconds=60), description="A connection that sends no request for this long "
        "(a new one, or a kept-alive one between requests), or stops reading its answer for "
        "this long, is closed. Also the /metrics listener's.")
    max_connections_per_client: int = Field(
        64, ge=1, le=100_000, description="Most connections one client address may hold "
        "open at once (an IPv6 client counted by its /64); more are answered 503 and closed "
        "at once. Behind a reverse proxy every client has the proxy's address: raise it "
        "there. Also the /metrics listener's.")

    @field_validator("header_timeout", "body_timeout", "idle_timeout")
    @classmethod
    def _positive(cls, v: timedelta) -> timedelta:
        if v.total_seconds() <= 0 or v > timedelta(hours=1):
            raise ValueError("must be more than 0 seconds and at most 1h")
        return v


class HttpPush(Frozen):
    enabled: bool = Field(True, description="Offer Web Push in the chat page (its bell "
                          "button): a reply to a chat no page has open is announced on the "
                          "devices subscribed to it. The VAPID key is made in "
                          "`data_dir/http/vapid.pem`; needs the `push` extra (pywebpush).")
    include_text: bool = Field(False, description="Put the first 200 characters of the reply "
                               "in the (encrypted) push payload, so the notification shows "
                               "them; off: it says only which chat has a new message.")
    contact: str = Field("mailto:mdclaw@localhost", pattern=r"^(mailto:|https://)\S+$",
                         description="The VAPID `sub` claim push services may contact the "
                         "sender by (a `mailto:` or `https://` URL; some services refuse "
                         "`localhost`).")


class HttpChannel(Frozen):
    enabled: bool = Field(True, description="Serve the local HTTP chat and its page on the "
                          "daemon's web server (`server`).")
    push: HttpPush = Field(default_factory=HttpPush, description="Web Push of replies "
                           "(notifications on a phone or desktop).")
    # The old names of the web server's keys, from when the chat owned the server: read as
    # `server.<key>` (Config.web_server); check-config warns (old_server_keys).
    listen: str | None = Field(
        None, pattern=LISTEN_PATTERN, description="Deprecated: the old name of "
        "`server.listen`, read as it (check-config warns; a different `server.listen` is an "
        "error).")
    secret_file: SecretFile | None = Field(
        None, description="Deprecated: the old name of `server.secret_file`, read as it.")
    generate_secret: bool | None = Field(
        None, description="Deprecated: the old name of `server.generate_secret`, read as it.")


class TelegramChannel(Frozen):
    enabled: bool = Field(True, description="Connect to Telegram.")
    token_file: SecretFile = Field(description="File holding the bot token.")
    api_base: str = Field("https://api.telegram.org", pattern=r"^https?://",
                          description="Bot API base URL (for a local Bot API server or tests).")
    pool_token_files: tuple[SecretFile, ...] = Field(
        (), max_length=50, description="Files each holding the token of one more bot, a pool "
        "for sub-agents' names: an agent's `send_message` with `sender: \"Researcher\"` "
        "posts through a pool bot renamed to Researcher (one bot per group and name, kept "
        "across restarts). Add each pool bot to the chats where it should speak; the main "
        "bot posts instead (with the name as a prefix) when no pool bot is free, is in the "
        "chat or works (docs/channels.md).")


class DiscordChannel(Frozen):
    enabled: bool = Field(True, description="Connect to Discord as a bot (needs the `discord` "
                          "extra).")
    token_file: SecretFile = Field(description="File holding the bot token (Developer Portal "
                                   "→ your application → Bot → Reset Token).")
    api_base: str = Field("https://discord.com/api/v10", pattern=r"^https?://",
                          description="REST API base URL, version included (for tests); the "
                          "gateway's address is asked of it.")


class WhatsAppChannel(Frozen):
    enabled: bool = Field(True, description="Connect to WhatsApp as a linked device of your "
                          "phone's account (pair with `mdclaw whatsapp link`).")
    session_file: Path | None = Field(
        None, description="Where the linked device's keys are kept (an SQLite file, mode "
        "0600; whoever reads it can act as your WhatsApp account). Default: "
        "data_dir/whatsapp/session.sqlite3.")
    send_interval: float = Field(
        1.0, ge=0, le=60, description="Seconds between two messages the assistant sends "
        "(WhatsApp bans accounts that send in bursts).")


_ADDRESS = re.compile(r"^[^@\s<>(),;:\"\[\]\\]+@[A-Za-z0-9.-]+\.[A-Za-z0-9-]+$")


def _mail_address(value: Any) -> str:
    """An e-mail address, lower-cased (as the email channel compares senders)."""
    text = str(value).strip().lower() if isinstance(value, str) else ""
    if not _ADDRESS.match(text):
        raise ValueError(f"{short_repr(value)} is not a mail address such as "
                         "alice@example.org")
    return text


MailAddress = Annotated[str, BeforeValidator(_mail_address)]
MailSecurity = Literal["tls", "starttls", "none"]


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class EmailChannel(Frozen):
    enabled: bool = Field(True, description="Read the mailbox and send the assistant's answers "
                          "by mail (jids mail:<address>; docs/channels.md: Email).")
    address: MailAddress = Field(
        description="The assistant's own address: the From of its mail. Mail from it is "
        "never answered.")
    display_name: str | None = Field(
        None, min_length=1, max_length=100,
        description="The name shown with `address` in the From of its mail (default: the "
        "assistant's name).")
    user: str | None = Field(
        None, min_length=1, description="Login name on the IMAP and SMTP servers (default: "
        "`address`).")
    password_file: SecretFile = Field(
        description="File holding the password (Gmail: an app password) for IMAP, and for "
        "SMTP unless `smtp_password_file` is set.")
    imap_host: str = Field(min_length=1, pattern=r"^[^\s/]+$",
                           description="The IMAP server, e.g. imap.gmail.com.")
    imap_port: int | None = Field(None, ge=1, le=65535,
                                  description="Default: 993 with `imap_security: tls`, 143 "
                                  "otherwise.")
    imap_security: MailSecurity = Field(
        "tls", description="tls: TLS from the first byte (port 993); starttls: plain, then "
        "STARTTLS before the login (port 143); none: no encryption, only to a server on this "
        "machine (localhost).")
    mailbox: str = Field("INBOX", min_length=1,
                         description="The folder whose new mail reaches the assistant.")
    poll_interval: Duration = Field(
        timedelta(seconds=60), description="How often the mailbox is looked at when the "
        "server has no IMAP IDLE (with IDLE, new mail comes at once).")
    smtp_host: str = Field(min_length=1, pattern=r"^[^\s/]+$",
                           description="The SMTP server mail is sent through, e.g. "
                           "smtp.gmail.com.")
    smtp_port: int | None = Field(None, ge=1, le=65535,
                                  description="Default: 465 with `smtp_security: tls`, 587 "
                                  "with starttls, 25 with none.")
    smtp_security: MailSecurity = Field(
        "tls", description="tls: TLS from the first byte (port 465); starttls: STARTTLS "
        "before the login (port 587); none: no encryption, only to a server on this machine.")
    smtp_user: str | None = Field(None, min_length=1,
                                  description="SMTP login name, when it is not `user`.")
    smtp_password_file: SecretFile | None = Field(
        None, description="File holding the SMTP password, when it is not `password_file`'s.")
    ca_file: Path | None = Field(
        None, description="PEM file of the certificate authorities to trust for both servers "
        "(a self-hosted server with a certificate of its own CA); default: the system's.")
    allow_from: tuple[MailAddress, ...] = Field(
        (), description="Senders whose mail reaches the assistant; mail from anyone else is "
        "left unread in the mailbox and never answered. Empty: no one's.")
    authserv_id: str | None = Field(
        None, min_length=1, pattern=r"^[^\s;]+$",
        description="The name your mail server signs its Authentication-Results header with "
        "(Gmail: mx.google.com). Set: a mail reaches the assistant only when that header says "
        "its sender passed DMARC, or DKIM or SPF for the From address's domain. Required "
        "with `allow_from`, unless `trust_from` says the From address alone is believed "
        "(docs/security.md).")
    trust_from: bool = Field(
        False, description="Believe a mail's From address without `authserv_id`'s check: "
        "anyone who knows an allowed address can then write as that person. Only for a "
        "mailbox that receives nothing but mail already authenticated (a server that takes "
        "mail only from its own logged-in users); doctor warns while it is set.")

    @property
    def login(self) -> str:
        return self.user or self.address

    @property
    def smtp_login(self) -> str:
        return self.smtp_user or self.login

    @property
    def imap_port_used(self) -> int:
        return self.imap_port or (993 if self.imap_security == "tls" else 143)

    @property
    def smtp_port_used(self) -> int:
        return self.smtp_port or {"tls": 465, "starttls": 587, "none": 25}[self.smtp_security]

    @model_validator(mode="after")
    def _plain_only_here(self) -> EmailChannel:
        bad: list[tuple[tuple[str, ...], str]] = []
        for kind, host, sec in (("imap", self.imap_host, self.imap_security),
                                ("smtp", self.smtp_host, self.smtp_security)):
            if sec == "none" and not _is_loopback(host):
                bad.append(((f"{kind}_security",), f"`none` sends the password unencrypted: "
                            f"only for a server on this machine, and {kind}_host is {host!r}; "
                            "use tls or starttls"))
        if self.allow_from and self.authserv_id is None and not self.trust_from:
            bad.append((("authserv_id",), "mail from allow_from reaches the agent only when "
                        "its sender is verified: set authserv_id to the name your mail "
                        "server writes in its Authentication-Results header (Gmail: "
                        "mx.google.com), or trust_from: true where the mailbox takes only "
                        "authenticated mail (docs/security.md)"))
        if bad:
            raise CrossKeyError(bad)
        return self


class SlackChannel(Frozen):
    enabled: bool = Field(True, description="Connect to Slack (Socket Mode: no public URL "
                          "needed).")
    bot_token_file: SecretFile = Field(
        description="File holding the bot token (xoxb-...; OAuth & Permissions).")
    app_token_file: SecretFile = Field(
        description="File holding the app-level token (xapp-..., scope connections:write; "
        "Basic Information → App-Level Tokens), for Socket Mode.")
    api_base: str = Field("https://slack.com/api/", pattern=r"^https?://",
                          description="Web API base URL (for tests).")


MATRIX_USER_ID = r"^@[^:\s]+:[^\s]+$"


class MatrixChannel(Frozen):
    enabled: bool = Field(True, description="Connect to the Matrix homeserver as the bot "
                          "account `user_id`.")
    homeserver: str = Field(pattern=r"^https?://", description="The homeserver's client API "
                            "address, e.g. https://matrix.example.org (where `/_matrix/client` "
                            "is served).")
    user_id: str = Field(pattern=MATRIX_USER_ID, description="The bot account, e.g. "
                         "@mdclaw:example.org (make it an account of its own, not yours).")
    access_token_file: SecretFile | None = Field(
        None, description="File holding the bot account's access token. Give this or "
        "`password_file`.")
    password_file: SecretFile | None = Field(
        None, description="File holding the bot account's password: mdclaw logs in once and "
        "keeps the access token it gets in data_dir/matrix/session.json (mode 0600), logging "
        "in again only when the homeserver stops accepting it.")
    device_name: str = Field("mdclaw", min_length=1, max_length=100,
                             description="The name of the login's device, as the account's "
                             "session list shows it (password login only).")
    allow_invites_from: tuple[str, ...] = Field(
        (), description="Matrix user ids (@alice:example.org) whose invites the bot accepts; "
        "invites from anyone else are ignored. Rooms are chats `mx:<room id>`.")

    @field_validator("allow_invites_from")
    @classmethod
    def _user_ids(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [u for u in v if not re.match(MATRIX_USER_ID, u)]
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))}: not a Matrix user id; write "
                             "@name:server (e.g. @alice:example.org)")
        return v

    @model_validator(mode="after")
    def _one_credential(self) -> MatrixChannel:
        given = [k for k in ("access_token_file", "password_file")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            where = (given[1],) if given else ()
            raise CrossKeyError([(where, "give exactly one of access_token_file, password_file "
                                         f"(got {given or 'none'})")])
        return self


class Channels(Frozen):
    http: HttpChannel | None = Field(
        default_factory=HttpChannel,
        description="Local HTTP chat (jids hl:<id>), on by default, served by the daemon's "
        "web server (`server`).")
    telegram: TelegramChannel | None = Field(None, description="Telegram bot (jids tg:<chat id>).")
    discord: DiscordChannel | None = Field(
        None, description="Discord bot (jids dc:<channel id>; a thread belongs to its "
        "channel).")
    whatsapp: WhatsAppChannel | None = Field(
        None, description="WhatsApp linked device (jids wa:<jid>, e.g. "
        "wa:120363012345678901@g.us for a group, wa:4915112345678@s.whatsapp.net for a person).")
    email: EmailChannel | None = Field(
        None, description="Mail through an IMAP mailbox and an SMTP server (jids "
        "mail:<address>, one chat per person).")
    slack: SlackChannel | None = Field(
        None, description="Slack app in Socket Mode (jids slack:<channel id>, e.g. "
        "slack:C0123456789; a direct message's channel id starts with D).")
    matrix: MatrixChannel | None = Field(
        None, description="Matrix bot account on your homeserver (jids mx:<room id>, e.g. "
        "mx:!aBcDeFgHiJkLmNoP:example.org, or mx:!aBcDeFgHiJkLmNoPqRsTuVwXyZ012345678 in rooms "
        "of version 12 and later).")


class Media(Frozen):
    max_bytes: Size = Field(
        "20M", description="Largest file a person may send the assistant (photo, document, "
        "audio, voice note, web chat upload); a larger one is not saved and the chat is told. "
        "Telegram's Bot API lets bots download at most 20 MB whatever this says.")

    @property
    def limit(self) -> int:
        """`max_bytes` in bytes."""
        return parse_size(self.max_bytes)


class Transcription(Frozen):
    provider: Literal["local", "openai"] = Field(
        description="local: a faster-whisper model on this machine's CPU (int8; needs the "
        "`transcribe` extra); openai: an OpenAI-compatible /audio/transcriptions endpoint.")
    model: str | None = Field(
        None, min_length=1, description="local: a faster-whisper model name (tiny, base, "
        "small...) or the path of a downloaded model folder, default base; openai: the "
        "model name, default whisper-1.")
    base_url: str | None = Field(
        None, pattern=r"^https?://", description="openai: the API root the "
        "/audio/transcriptions path is added to (default https://api.openai.com/v1).")
    api_key_file: SecretFile | None = Field(
        None, description="openai: file holding the API key (sent as a bearer token).")
    language: str | None = Field(
        None, pattern=r"^[A-Za-z]{2,3}$",
        description="Language of the voice notes (ISO 639-1, e.g. en); default: detected.")
    timeout: Duration = Field(timedelta(minutes=2),
                              description="Longest a transcription may take.")

    @property
    def model_name(self) -> str:
        return self.model or ("base" if self.provider == "local" else "whisper-1")

    @property
    def url(self) -> str:
        """The transcription endpoint (openai)."""
        return (self.base_url or "https://api.openai.com/v1").rstrip("/") + \
            "/audio/transcriptions"


class HomeAssistantAllow(Frozen):
    services: tuple[Glob, ...] = Field(
        (), description="Services agents may call, as fnmatch patterns of `domain.service` "
        "(`light.*`, `switch.turn_on`). Empty (the default): none, read-only.")
    entities: tuple[Glob, ...] = Field(
        (), description="Entities agents may read and act on, as fnmatch patterns of the "
        "entity id (`light.*`, `climate.greenhouse`). Empty (the default): none.")


class HomeAssistant(Frozen):
    url: str = Field(pattern=r"^https?://[^\s/]+(/[^\s]*)?$",
                     description="Home Assistant's base URL, e.g. http://homeassistant.local:8123.")
    token_file: SecretFile = Field(
        description="File holding a long-lived access token (HA profile → Security → "
        "Long-lived access tokens). Read on the host only; never sent to a container.")
    dashboards_dir: Path | None = Field(
        None, description="Folder of the Lovelace YAML dashboards (and canvas specs) the "
        "dashboard actions read and edit; host-only, never mounted into a container.")
    allow: HomeAssistantAllow = Field(
        default_factory=HomeAssistantAllow,
        description="What agents may call and see; the default allows nothing (read-only "
        "status only).")
    timeout: Duration = Field(timedelta(seconds=20),
                              description="Longest one request to Home Assistant may take.")
    chromium: str | None = Field(
        None, min_length=1, description="Chromium binary ha_capture_screenshot runs on the "
        "host; default: chromium (or chromium-browser, google-chrome) on PATH.")

    @field_validator("url")
    @classmethod
    def _strip_slash(cls, v: str) -> str:
        return v.rstrip("/")

    @field_validator("dashboards_dir")
    @classmethod
    def _absolute_dashboards(cls, v: Path | None) -> Path | None:
        if v is None:
            return None
        v = Path(os.path.expanduser(str(v)))
        if not v.is_absolute():
            raise ValueError("dashboards_dir must be an absolute path")
        return v


class Integrations(Frozen):
    home_assistant: HomeAssistant | None = Field(
        None, description="Home Assistant actions (ha_*, farm_state_refresh); "
        "docs/integrations.md.")


class WebSearch(Frozen):
    provider: Literal["searxng", "brave"] = Field(
        description="searxng: a SearXNG instance (its JSON API must be enabled: "
        "`search.formats: [html, json]` in its settings.yml); brave: the Brave Search API.")
    url: str | None = Field(
        None, description="searxng: the instance's URL, e.g. http://searx.lan:8080 (the "
        "operator's own choice: not checked against the private-address rule). brave: the "
        "API endpoint (default https://api.search.brave.com/res/v1/web/search).")
    api_key_file: SecretFile | None = Field(
        None, description="brave: file holding the subscription token (never logged).")
    max_results: int = Field(10, ge=1, le=50, description="Most results one search returns.")

    @model_validator(mode="after")
    def _provider_needs(self) -> WebSearch:
        if self.provider == "searxng" and not self.url:
            raise CrossKeyError([(("url",), "searxng needs `url`: the instance's address, "
                                  "e.g. http://searx.lan:8080")])
        if self.provider == "brave" and self.api_key_file is None:
            raise CrossKeyError([(("api_key_file",), "brave needs `api_key_file`: a file "
                                  "holding the API token (chmod 600)")])
        if self.url and not self.url.startswith(("http://", "https://")):
            raise CrossKeyError([(("url",), f"{self.url!r} is not an http(s) URL")])
        return self


class Metrics(Frozen):
    enabled: bool = Field(
        True, description="Serve Prometheus metrics at `/metrics` on the daemon's web server "
        "(`server`; and on `listen`, when set), behind the operator page's access rule: the "
        "server's bearer token when it has one, else loopback clients only (docs/metrics.md).")
    listen: str | None = Field(
        None, pattern=LISTEN_PATTERN,
        description="host:port of a listener of its own that serves only `/metrics` (e.g. "
        "`127.0.0.1:9464`), for scraping apart from the web server. Same access rule; the "
        "token is the web server's (`server.secret_file` or the generated one).")


class Web(Frozen):
    enabled: bool = Field(
        False, description="Let agents fetch web pages and search (the web_fetch and "
        "web_search actions); the host does the fetching, containers keep no network. Off "
        "by default: pages an agent reads can carry instructions to it. Per group: "
        "`groups.<g>.actions`.")
    allow_domains: tuple[Domain, ...] = Field(
        (), description="Only these domains (and their subdomains) may be fetched; empty: "
        "any public domain.")
    deny_domains: tuple[Domain, ...] = Field(
        (), description="These domains (and their subdomains) are never fetched; wins over "
        "allow_domains.")
    allow_private: tuple[Cidr, ...] = Field(
        (), description="Non-public address ranges fetches may reach anyway, e.g. "
        "['192.168.1.20/32'] for one LAN host. Empty: loopback, private, link-local, "
        "multicast, reserved and the host's own addresses are all refused.")
    max_bytes: Size = Field("2MiB", description="Most bytes of one response body read.")
    max_chars: int = Field(20_000, ge=100, le=1_000_000,
                           description="Most characters of text one fetch returns (an agent "
                           "may ask for fewer).")
    timeout: Duration = Field(timedelta(seconds=20),
                              description="Time one fetch (all redirects) may take.")
    max_redirects: int = Field(5, ge=0, le=20,
                               description="Redirects followed; each target is checked again.")
    content_types: tuple[str, ...] = Field(
        ("text/html", "application/xhtml+xml", "text/plain", "text/markdown", "text/csv",
         "application/json", "application/xml", "text/xml"),
        description="Response media types accepted; others are refused.")
    user_agent: str = Field("mdclaw-web/0.1", description="User-Agent of the host's requests.")
    search: WebSearch | None = Field(None, description="The web_search provider; unset: "
                                     "web_search answers that no provider is configured.")


# --------------------------------------------------------------------------- MCP servers

_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
_HEADER_NAME = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}$"
# A server's name is the first half of the tool names agents see (`<server>__<tool>`): no
# double underscore, so the split is never ambiguous.
MCP_SERVER_NAME = r"^[a-z0-9]+(?:[-_][a-z0-9]+)*$"
McpServerName = Annotated[str, Field(pattern=MCP_SERVER_NAME, max_length=32)]
# An fnmatch pattern of an MCP server's tool names (`*`, `git_*`, `get_?ime`).
McpToolGlob = Annotated[str, Field(min_length=1, max_length=128,
                                   pattern=r"^[A-Za-z0-9_.*?!-]+$")]
EnvName = Annotated[str, Field(pattern=_ENV_NAME)]
HeaderName = Annotated[str, Field(pattern=_HEADER_NAME)]


class McpApprove(Frozen):
    always: tuple[McpToolGlob, ...] = Field(
        (), description="Tools (fnmatch patterns of the server's tool names) that always need "
        "a person's approval, whatever their annotations say. Wins over `never`.")
    never: tuple[McpToolGlob, ...] = Field(
        (), description="Tools that never need approval, whatever their annotations say.")


class McpServer(Frozen):
    command: str | None = Field(
        None, min_length=1, description="stdio server: the program the host starts (a path, "
        "or a name on PATH), as mdclaw's own user, never in an agent container.")
    args: tuple[str, ...] = Field((), description="stdio server: its arguments.")
    url: str | None = Field(
        None, pattern=r"^https?://", description="Streamable HTTP server: its endpoint, "
        "e.g. http://127.0.0.1:8931/mcp.")
    socket: Path | None = Field(
        None, description="A unix socket that speaks the stdio framing (one JSON-RPC message "
        "a line): a stdio server run as a service of its own (the NixOS module's "
        "`mcpServers`). Absolute path.")
    env: dict[EnvName, str] = Field(
        {}, description="stdio server: environment variables (not secrets: these are in the "
        "config). The server gets only these, the `env_files` ones, PATH, HOME, LANG and TZ.")
    env_files: dict[EnvName, SecretFile] = Field(
        {}, description="stdio server: environment variables whose values are secrets, each "
        "read from a file (like every `*_file` key) on the host when the server starts.")
    headers: dict[HeaderName, str] = Field(
        {}, description="HTTP server: headers sent with every request.")
    header_files: dict[HeaderName, SecretFile] = Field(
        {}, description="HTTP server: headers whose values are secrets, each read from a file "
        "(e.g. `Authorization` holding `Bearer <token>`).")
    cwd: Path | None = Field(None, description="stdio server: its working directory "
                             "(default: mdclaw's own). Absolute path.")
    timeout: Duration = Field(timedelta(seconds=60), le=timedelta(hours=1),
                              description="Longest one tool call may take, a wait for a free "
                              "slot included; then the agent gets an error. At most 1h.")
    start_timeout: Duration = Field(timedelta(seconds=30), le=timedelta(minutes=10),
                                    description="Longest a start may take (the process, the "
                                    "initialize handshake and the tool list).")
    max_result_bytes: Size = Field(
        "1MiB", description="Largest message the server may send (a tool result, a tool "
        "list), counted at the transport before anything is parsed; a larger one is "
        "dropped unread and the call gets an error.")
    max_concurrent: int = Field(4, ge=1, le=64,
                                description="Calls this server runs at once, all groups.")
    max_concurrent_per_group: int = Field(2, ge=1, le=64,
                                          description="Calls one group may have running on "
                                          "this server at once.")
    approve: McpApprove = Field(
        default_factory=McpApprove, description="Which tools need a person's approval. By "
        "default a tool does unless its annotations say it is read-only (`readOnlyHint`) and "
        "not destructive.")

    @model_validator(mode="after")
    def _one_transport(self) -> McpServer:
        given = [k for k in ("command", "url", "socket") if getattr(self, k) is not None]
        if len(given) != 1:
            where = (given[1],) if given else ()
            raise CrossKeyError([(where, "give exactly one of command (a stdio server the "
                                  "host starts), url (a streamable HTTP server) or socket "
                                  f"(got {given or 'none'})")])
        problems: list[Problem] = []
        if self.command is None:
            problems += [((k,), f"{k} is for a stdio server (`command`)")
                         for k in ("args", "env", "env_files", "cwd") if getattr(self, k)]
        if self.url is None:
            problems += [((k,), f"{k} is for an HTTP server (`url`)")
                         for k in ("headers", "header_files") if getattr(self, k)]
        for key in ("socket", "cwd"):
            value = getattr(self, key)
            if value is not None and not Path(value).is_absolute():
                problems.append(((key,), f"{key} must be an absolute path"))
        if problems:
            raise CrossKeyError(problems)
        return self

    @property
    def kind(self) -> str:
        """stdio, http or socket."""
        return "stdio" if self.command else "http" if self.url else "socket"

    @property
    def result_limit(self) -> int:
        """`max_result_bytes` in bytes."""
        return parse_size(self.max_result_bytes)
