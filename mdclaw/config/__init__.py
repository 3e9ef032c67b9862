"""The declarative configuration: `config.yaml` is the desired state.

One concern a module:

- `types`: the value types keys are made of (durations, sizes, folders, time zones, secret
  paths...) with their parse/format functions, and the base of every section model;
- `schema`, `schema_groups`, `schema_services`: the pydantic models (Config and its
  sections) and the rules across keys;
- `load`: reading config.yaml with line numbers, ConfigIssue/ConfigError, `load_config`;
- `secrets`: secret files: the one pass that checks them (`secret_file_issues`), reading
  them, showing them as set/missing, the local HTTP channel's token file;
- `live`: the running config every component reads at use time (`LiveConfig`) and what a
  reload may change.

Environment variables with the `MDCLAW_` prefix override the file (`MDCLAW_DATA_DIR`,
`MDCLAW_ASSISTANT__NAME`, ...). Secrets are never written inline: keys ending in `_file` name
a file that holds the secret; it is read only when needed and never logged.

`from mdclaw.config import X` works for every public name of these modules.
"""

from mdclaw.config.extras import (
    EXTRAS,
    Extra,
    ExtraMissing,
    MissingExtra,
    check_extras,
    check_programs,
    missing_extras,
    require_extra,
)
from mdclaw.config.live import RESTART_ONLY, LiveConfig, reload_config, restart_only_changes
from mdclaw.config.load import (
    DEFAULT_CONFIG_PATHS,
    ConfigError,
    ConfigIssue,
    file_key_lines,
    find_config_path,
    issue_at,
    key_lines,
    line_of,
    load_config,
    sorted_issues,
)
from mdclaw.config.schema import (
    SERVER_KEYS,
    AllowedRoot,
    AllowSenders,
    ApprovalMatch,
    ApprovalRule,
    Approvals,
    Assistant,
    Channels,
    Config,
    EmailChannel,
    Group,
    GroupMount,
    HomeAssistant,
    HomeAssistantAllow,
    HttpChannel,
    Integrations,
    Limits,
    McpApprove,
    McpServer,
    Media,
    Metrics,
    ModelSpec,
    MountPolicy,
    Person,
    Runtime,
    Server,
    SlackChannel,
    TaskSpec,
    TelegramChannel,
    Transcription,
    Web,
    WebSearch,
    WhatsAppChannel,
    cross_key_problems,
    network_problem,
    old_server_key_warnings,
    old_server_keys,
    server_key_problems,
)
from mdclaw.config.secrets import (
    HTTP_SECRET_NAME,
    ServiceCredential,
    check_secret_files,
    config_for_display,
    config_text_for_display,
    ensure_http_secret,
    http_secret_path,
    iter_secret_files,
    read_secret,
    secret_file_issues,
    secret_file_problem,
    secret_state,
    service_credential_secrets,
)
from mdclaw.config.types import (
    CREDENTIALS_VAR,
    FLOOR_PATTERN,
    FOLDER_CASE_RULE,
    FOLDER_RE,
    RESERVED_FOLDERS,
    SIZE_PATTERN,
    CrossKeyError,
    Duration,
    Folder,
    Frozen,
    Problem,
    SecretFile,
    Size,
    SizeOrPercent,
    TimeZone,
    floor_bytes,
    folder_clash,
    folder_key,
    format_duration,
    format_size,
    in_service_credentials,
    parse_duration,
    parse_size,
    validate_folder,
)

__all__ = [
    "CREDENTIALS_VAR", "DEFAULT_CONFIG_PATHS", "EXTRAS", "Extra", "ExtraMissing", "MissingExtra",
    "check_extras", "check_programs", "missing_extras", "require_extra", "FLOOR_PATTERN",
    "FOLDER_CASE_RULE", "FOLDER_RE", "HTTP_SECRET_NAME",
    "RESERVED_FOLDERS", "RESTART_ONLY", "SERVER_KEYS", "SIZE_PATTERN", "AllowSenders",
    "AllowedRoot", "ApprovalMatch", "ApprovalRule", "Approvals", "Assistant", "Channels",
    "Config", "ConfigError", "ConfigIssue", "CrossKeyError",
    "Duration", "EmailChannel", "Folder", "Frozen", "Group", "GroupMount", "HomeAssistant",
    "HomeAssistantAllow", "HttpChannel", "Integrations", "Limits", "LiveConfig", "McpApprove",
    "McpServer", "Media", "Metrics", "ModelSpec", "MountPolicy", "Person", "Problem", "Runtime",
    "SecretFile", "Server", "ServiceCredential", "Size", "SizeOrPercent", "SlackChannel",
    "TaskSpec", "TelegramChannel", "TimeZone",
    "Transcription", "Web", "WebSearch", "WhatsAppChannel", "check_secret_files",
    "config_for_display", "config_text_for_display", "cross_key_problems",
    "ensure_http_secret", "file_key_lines",
    "find_config_path", "floor_bytes", "folder_clash", "folder_key", "format_duration",
    "format_size", "http_secret_path",
    "in_service_credentials", "issue_at", "iter_secret_files", "key_lines", "line_of",
    "load_config", "network_problem", "old_server_key_warnings", "old_server_keys",
    "parse_duration", "parse_size", "read_secret",
    "reload_config", "restart_only_changes", "secret_file_issues", "secret_file_problem",
    "secret_state", "server_key_problems", "service_credential_secrets", "sorted_issues",
    "validate_folder",
]
