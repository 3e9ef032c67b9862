# services.mdclaw: the mdclaw daemon as a hardened systemd service.
#
# - `settings` is config.yaml as Nix; every key is a typed option made from mdclaw's own config
#   schema (settings-options.nix), and the rendered file is validated with `mdclaw check-config`
#   when it is built, so a bad config never reaches the running service.
# - Secrets stay out of the Nix store: `credentials` hands files to the service with systemd's
#   LoadCredential, and settings point at them as "$CREDENTIALS_DIRECTORY/<name>".
# - The agent image from the flake is loaded into the engine by mdclaw-image.service before the
#   daemon starts (skipped when the engine already has that exact image).
# - `mdclaw` on the PATH is a wrapper for the administrator: as root it runs the command as the
#   service's user with the service's credentials (systemd-run, LoadCredential); members of the
#   `mdclaw` group run the read-only commands as themselves.
# - The config lives at /etc/mdclaw/config.yaml: changing only settings reloads the daemon
#   (SIGHUP) instead of restarting it; a new package or image restarts it.
# - `mcpServers`: each stdio MCP server as a sandboxed service of its own, started by systemd
#   per connection of the daemon to its socket (Accept=yes: the connection is the server's
#   stdin and stdout), with a user of its own (DynamicUser) and no network unless allowed;
#   settings.mcp_servers.<name>.socket points the daemon at it.
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib)
    mkOption
    mkEnableOption
    mkIf
    mkDefault
    types
    literalExpression
    ;

  cfg = config.services.mdclaw;
  settingsFormat = pkgs.formats.yaml { };
  settingsOptions = import ./settings-options.nix { inherit lib settingsFormat; };

  exe = "${cfg.package}/bin/mdclaw";
  configPath = "/etc/mdclaw/config.yaml";

  # Unset keys are null in the options and untouched collections are empty; leave both out
  # so mdclaw's own defaults apply (every collection in the schema defaults to empty).
  isEmpty = x: x == null || x == { } || x == [ ];
  clean =
    v:
    if builtins.isAttrs v then
      lib.filterAttrs (_: x: !isEmpty x) (lib.mapAttrs (_: clean) v)
    else if builtins.isList v then
      map clean v
    else
      v;
  renderedSettings = clean cfg.settings;

  rawConfigFile = settingsFormat.generate "mdclaw-config.yaml" renderedSettings;

  # Checked at build time, as services.borgmatic does. Secret files and group mount paths
  # exist only on the machine that runs mdclaw, so mdclaw checks those when it starts.
  configFile =
    if cfg.checkConfig then
      pkgs.runCommand "mdclaw-config.yaml"
        {
          nativeBuildInputs = [ cfg.package ];
          preferLocalBuild = true;
          PYTHONTZPATH = "${pkgs.tzdata}/share/zoneinfo";
        }
        ''
          export HOME="$TMPDIR"
          cp ${rawConfigFile} config.yaml
          mdclaw check-config --skip-secrets --skip-host-checks --config config.yaml
          cp config.yaml "$out"
        ''
    else
      rawConfigFile;

  engine = {
    podman = {
      socket = "/run/podman/podman.sock";
      group = "podman";
      unit = "podman.socket";
    };
    docker = {
      socket = "/run/docker.sock";
      group = "docker";
      unit = "docker.service";
    };
  };
  eng = engine.${cfg.containerEngine};

  dataDir = cfg.settings.data_dir;
  stateDirName = lib.removePrefix "/var/lib/" dataDir;
  dataDirIsStateDir = lib.hasPrefix "/var/lib/" dataDir && stateDirName != "";

  # data_dir must be mdclaw's own folder: tmpfiles chowns it to mdclaw and the unit makes it
  # its only writable path, so a shared folder would be taken from everything else there.
  sharedFolders = [
    "/"
    "/bin"
    "/boot"
    "/dev"
    "/etc"
    "/home"
    "/lib"
    "/lib64"
    "/media"
    "/mnt"
    "/nix"
    "/opt"
    "/proc"
    "/root"
    "/run"
    "/sbin"
    "/srv"
    "/sys"
    "/tmp"
    "/usr"
    "/var"
    "/var/cache"
    "/var/db"
    "/var/empty"
    "/var/lib"
    "/var/log"
    "/var/spool"
    "/var/tmp"
  ];
  # Folders whose contents are not mdclaw's to keep: volatile, system-owned or users' homes.
  refusedTrees = [
    "/nix/"
    "/tmp/"
    "/var/tmp/"
    "/run/"
    "/proc/"
    "/sys/"
    "/dev/"
    "/etc/"
    "/usr/"
    "/boot/"
    "/home/"
    "/root/"
  ];
  dataDirProblem =
    let
      d = toString dataDir;
      parts = builtins.filter (x: x != "") (lib.splitString "/" d);
    in
    if !(lib.hasPrefix "/" d) then
      "is not an absolute path"
    else if d != "/" && (lib.hasSuffix "/" d || lib.hasInfix "//" d || builtins.elem "." parts || builtins.elem ".." parts) then
      "is not a plain path (no trailing '/', '//', '.' or '..')"
    else if builtins.elem d sharedFolders then
      "is a folder the whole system shares; mdclaw would own it (tmpfiles chowns it to mdclaw, mode 0750)"
    else if lib.hasPrefix "/home/" d || lib.hasPrefix "/root/" d then
      "is under a home folder: the unit hides /home and /root (ProtectHome) and the mdclaw user cannot enter a user's home"
    else if lib.any (t: lib.hasPrefix t d) refusedTrees then
      "is inside ${lib.findFirst (t: lib.hasPrefix t d) "" refusedTrees}, which is volatile or belongs to the system"
    else
      null;

  # Group mounts under /home or /root must stay visible to mdclaw, which checks them.
  mountRoots = map (r: r.path) (cfg.settings.mount_policy.allowed_roots or [ ]);
  needsHome = lib.any (p: lib.hasPrefix "/home" p || lib.hasPrefix "/root" p) mountRoots;

  # Every *_file value in the settings, with its key path, for the Nix-store check.
  secretPaths =
    let
      walk =
        path: v:
        if builtins.isAttrs v then
          lib.concatLists (lib.mapAttrsToList (k: x: walk (path ++ [ k ]) x) v)
        else if builtins.isList v then
          lib.concatLists (lib.imap0 (i: x: walk (path ++ [ (toString i) ]) x) v)
        else if
          builtins.isString v
          && (
            lib.hasSuffix "_file" (lib.last ([ "" ] ++ path))
            # NAME = file maps of secrets: mcp_servers.<s>.env_files, .header_files
            || lib.hasSuffix "_files" (lib.last ([ "" "" ] ++ lib.init ([ "" ] ++ path)))
          )
        then
          [
            {
              key = lib.concatStringsSep "." path;
              value = v;
            }
          ]
        else
          [ ];
    in
    walk [ ] renderedSettings;

  inStore = p: lib.hasPrefix "${builtins.storeDir}/" (toString p);
  folderOk =
    name:
    builtins.match "[A-Za-z0-9][A-Za-z0-9_-]{0,63}" name != null
    && !builtins.elem (lib.toLower name) [
      "global"
      "errors"
    ];
  claudeModels = lib.attrNames (lib.filterAttrs (_: m: m.backend == "claude") cfg.settings.models);
  usesClaude = claudeModels != [ ];
  imageBackends = if cfg.image == null then [ ] else cfg.image.mdclawBackends or [ "openai" "claude" ];

  # The daemon's web server (settings.server: the operator page, /metrics, the local chat).
  # Its keys' old names under settings.channels.http are read as them when server leaves them
  # unset, as mdclaw does (a null here is "unset": mdclaw's default applies).
  http = cfg.settings.channels.http;
  server = cfg.settings.server;
  oldServerKey = k: if http == null then null else http.${k};
  serverKey =
    k: default:
    if server != null && server.${k} != null then
      server.${k}
    else if oldServerKey k != null then
      oldServerKey k
    else
      default;
  # Whether settings set the web server's token under its old names (the module's default of
  # server.generate_secret would then be a second, different value).
  oldTokenKeysSet = oldServerKey "secret_file" != null || oldServerKey "generate_secret" != null;
  webListen = serverKey "listen" "127.0.0.1:3000";
  webMatch = builtins.match "(.*):([0-9]+)" webListen;
  webHost = if webMatch == null then "" else builtins.head webMatch;
  webPort = if webMatch == null then 0 else lib.toInt (lib.last webMatch);
  webLoopback = builtins.elem webHost [
    "127.0.0.1"
    "localhost"
    "::1"
    "[::1]"
  ] || lib.hasPrefix "127." webHost;
  webHasToken = serverKey "secret_file" null != null || serverKey "generate_secret" false == true;
  # Where the listen address was set, for the messages.
  listenKey =
    if oldServerKey "listen" != null && !(server != null && server.listen != null) then
      "settings.channels.http.listen"
    else
      "settings.server.listen";

  podmanCfg = config.virtualisation.podman;
  dockerCfg = config.virtualisation.docker;

  # The administrator's `mdclaw`: root gets the service's user, groups and credentials
  # (a transient unit with the same LoadCredential=, so `sudo mdclaw doctor` reads the secrets
  # as the service does); anyone else runs it as themselves (members of the `mdclaw` group can
  # read data_dir: status, doctor, groups/tasks/outbox list, usage, tasks logs).
  adminCli = pkgs.writeShellScriptBin "mdclaw" ''
    export MDCLAW_CONFIG=${configPath}
    case "''${1:-}" in
      run)
        echo "mdclaw: the daemon runs as mdclaw.service: systemctl start mdclaw (or restart, reload)" >&2
        exit 2
        ;;
    esac
    if [ "$(id -u)" = 0 ] && [ -z "''${MDCLAW_AS_ROOT:-}" ]; then
      if [ -t 0 ] && [ -t 1 ]; then io=--pty; else io=--pipe; fi
      exec ${config.systemd.package}/bin/systemd-run ${lib.concatStringsSep " " runAsService} -- ${exe} "$@"
    fi
    exec ${exe} "$@"
  '';
  runAsService = [
    "--quiet"
    "--collect"
    "--wait"
    "\"$io\""
    "--service-type=exec"
    "--uid=mdclaw"
    "--gid=mdclaw"
    "--property=SupplementaryGroups=${eng.group}"
    "--property=UMask=0027"
    "--working-directory=${dataDir}"
    "--setenv=MDCLAW_CONFIG=${configPath}"
  ]
  ++ map (c: "--property=LoadCredential=${lib.escapeShellArg c}") credentialSpecs;
  credentialSpecs = lib.mapAttrsToList (name: path: "${name}:${path}") cfg.credentials;

  # The sandbox every mdclaw unit gets (the daemon, the image loader, the backup timer's
  # service and each MCP server); each adds its user, home, /tmp and network below.
  sandbox = {
    NoNewPrivileges = true;
    PrivateDevices = true;
    ProtectSystem = "strict";
    ProtectKernelTunables = true;
    ProtectKernelModules = true;
    ProtectKernelLogs = true;
    ProtectControlGroups = true;
    ProtectClock = true;
    ProtectHostname = true;
    ProtectProc = "invisible";
    ProcSubset = "pid";
    RestrictNamespaces = true;
    RestrictRealtime = true;
    RestrictSUIDSGID = true;
    LockPersonality = true;
    RemoveIPC = true;
    CapabilityBoundingSet = "";
    AmbientCapabilities = "";
    SystemCallArchitectures = "native";
    SystemCallFilter = [
      "@system-service"
      "~@privileged"
      "~@resources"
    ];
    SystemCallErrorNumber = "EPERM";
  };
  # Shared by the daemon and the image loader.
  hardening = sandbox // {
    User = "mdclaw";
    Group = "mdclaw";
    SupplementaryGroups = [ eng.group ];
    UMask = "0027";
    # The engine resolves bind mounts in its own mount namespace, so data_dir (IPC and group
    # folders) must be a real host path: no PrivateTmp, no temporary filesystems over it.
    PrivateTmp = false;
    ProtectHome = if needsHome then "read-only" else true;
    RestrictAddressFamilies = [
      "AF_UNIX"
      "AF_INET"
      "AF_INET6"
      "AF_NETLINK"
    ];
  };

  backupPeriods = {
    hourly = "1h";
    daily = "1d";
    weekly = "7d";
    monthly = "30d";
  };
  bk = cfg.backup;
  backupArgs = lib.escapeShellArgs (
    [
      "backup"
      "--config"
      configPath
      "--to"
      bk.directory
      "--keep"
      (toString bk.keep)
    ]
    ++ lib.optionals (bk.ageRecipientFile != null) [
      "--age-recipients"
      "${bk.ageRecipientFile}"
    ]
    ++ lib.optionals (bk.expectEvery != null) [
      "--every"
      bk.expectEvery
    ]
  );
  # MCP servers run as services of their own (mcpServers): one socket each, a service
  # instance per connection (the daemon holds one).
  mcpSocket = name: "/run/mdclaw-mcp/${name}.sock";
  mcpNameOk = name: builtins.match "[a-z0-9]+([-_][a-z0-9]+)*" name != null && builtins.stringLength name <= 32;
  mcpExec =
    name: s:
    let
      exports = lib.concatStrings (
        lib.mapAttrsToList (
          var: _: "export ${var}=\"$(< \"$CREDENTIALS_DIRECTORY/${var}\")\"\n"
        ) s.credentials
      );
    in
    pkgs.writeShellScript "mdclaw-mcp-${name}" ''
      set -eu
      ${exports}exec ${lib.escapeShellArgs ([ s.command ] ++ s.args)}
    '';
  mcpHardening = sandbox // {
    PrivateTmp = true;
    ProtectHome = true;
    UMask = "0077";
  };
  mcpServiceConfig =
    name: s:
    mcpHardening
    // {
      ExecStart = "${mcpExec name s}";
      StandardInput = "socket";
      StandardOutput = "socket";
      StandardError = "journal";
      PrivateNetwork = !s.network;
      RestrictAddressFamilies = if s.network then [ "AF_UNIX" "AF_INET" "AF_INET6" ] else [ "AF_UNIX" ];
      ReadWritePaths = s.readWritePaths;
      ReadOnlyPaths = s.readOnlyPaths;
      LoadCredential = lib.mapAttrsToList (var: path: "${var}:${path}") s.credentials;
      RuntimeMaxSec = "1d";
    }
    // (if s.user == null then { DynamicUser = true; } else { User = s.user; Group = s.user; })
    // lib.optionalAttrs (s.workingDirectory != null) { WorkingDirectory = s.workingDirectory; }
    // s.serviceConfig;

  mcpConfig = {
    systemd.sockets = lib.mapAttrs' (
      name: _:
      lib.nameValuePair "mdclaw-mcp-${name}" {
        description = "mdclaw's MCP server ${name}: its socket";
        wantedBy = [ "sockets.target" ];
        listenStreams = [ (mcpSocket name) ];
        socketConfig = {
          Accept = true;
          SocketUser = "mdclaw";
          SocketGroup = "mdclaw";
          SocketMode = "0600";
          DirectoryMode = "0755";
          MaxConnections = 4;
        };
      }
    ) cfg.mcpServers;
    systemd.services = lib.mapAttrs' (
      name: s:
      lib.nameValuePair "mdclaw-mcp-${name}@" {
        description = "mdclaw's MCP server ${name}";
        environment = s.environment;
        serviceConfig = mcpServiceConfig name s;
      }
    ) cfg.mcpServers;
  };

  groups = cfg.settings.groups;
  mainGroups = lib.attrNames (lib.filterAttrs (_: g: g.main == true) groups);
  modelNames = lib.attrNames cfg.settings.models;
  usedModels =
    lib.optional (cfg.settings.assistant.model != null) {
      where = "assistant.model";
      model = cfg.settings.assistant.model;
    }
    ++ lib.mapAttrsToList (name: g: {
      where = "groups.${name}.model";
      model = g.model;
    }) (lib.filterAttrs (_: g: g.model != null) groups);
in
{
  options.services.mdclaw = {
    enable = mkEnableOption "mdclaw, the self-hosted personal AI assistant host";

    package = mkOption {
      type = types.package;
      default = pkgs.mdclaw;
      defaultText = literalExpression "mdclaw.packages.\${system}.mdclaw (or pkgs.mdclaw with the overlay)";
      description = "The mdclaw package.";
    };

    image = mkOption {
      type = types.nullOr types.package;
      default =
        if usesClaude then pkgs.mdclaw-agent-image-claude or null else pkgs.mdclaw-agent-image or null;
      defaultText = literalExpression "mdclaw.packages.\${system}.container-image (openai backend, free), or container-image-claude when a model uses the claude backend";
      description = ''
        The agent image (the flake's `container-image`, a docker-archive tarball), loaded
        into the container engine with `mdclaw image load` by `mdclaw-image.service` before
        the daemon starts (skipped when the engine already has that exact image). The
        default is the free image (openai backend: local and OpenAI-compatible models), or
        the Claude image when a model in `settings.models` uses `backend = "claude"`; that one
        holds Anthropic's Claude Code CLI, which is unfree (see the manual).
        `settings.runtime.image` defaults to its name and tag, so an upgrade switches the
        agents to the new image. Null: manage the image yourself (`mdclaw image build`) and
        set `settings.runtime.image`.
      '';
    };

    openFirewall = mkOption {
      type = types.bool;
      default = false;
      description = ''
        Open the daemon's web server's port (`settings.server.listen`: the operator page,
        /metrics and the local HTTP chat) in the firewall. Needs a listen address other than
        loopback, and a token (the module generates one by default:
        `settings.server.generate_secret`).
      '';
    };

    containerEngine = mkOption {
      type = types.enum [
        "podman"
        "docker"
      ];
      default = "podman";
      description = ''
        The engine that runs the agent containers. `podman` enables Podman, and mdclaw talks
        to its API socket at /run/podman/podman.sock (it needs no /run/docker.sock, so
        dockerd may run beside it); `docker` enables dockerd. Either way the `mdclaw` user joins the engine's socket group, which
        is as good as root on this machine: agents are still confined by their containers.
      '';
    };

    credentials = mkOption {
      type = types.attrsOf (
        types.addCheck types.str (p: lib.hasPrefix "/" p && !inStore p)
        // {
          description = "absolute path outside the Nix store";
        }
      );
      default = { };
      example = literalExpression ''
        {
          anthropic = "/run/secrets/anthropic-api-key";
          telegram = "/run/agenix/mdclaw-telegram-token";
        }
      '';
      description = ''
        Secret files handed to the service with systemd's `LoadCredential`: each NAME = PATH
        appears to mdclaw, readable only by the service, as
        `$CREDENTIALS_DIRECTORY/NAME`. Use that string for the `*_file` settings, e.g.
        `settings.models.claude.api_key_file = "$CREDENTIALS_DIRECTORY/anthropic"`.
        The source files can belong to root and stay unreadable to the mdclaw user; nothing
        of them enters the Nix store.
      '';
    };

    settings = mkOption {
      type = settingsOptions.type;
      default = { };
      example = literalExpression ''
        {
          assistant = { name = "Andy"; timezone = "Europe/Berlin"; model = "claude"; };
          models.claude = {
            backend = "claude";
            model = "claude-sonnet-4-5";
            api_key_file = "$CREDENTIALS_DIRECTORY/anthropic";
          };
          groups.main = { name = "Admin"; jid = "hl:main"; main = true; };
        }
      '';
      description = ''
        mdclaw's config.yaml as Nix (see docs/configuration.md for every key). Each key is a
        typed option taken from mdclaw's config schema; unset keys keep mdclaw's defaults.
        The file is written to ${configPath} and checked with `mdclaw check-config` at build
        time.
      '';
    };

    mcpServers = mkOption {
      type = types.attrsOf (
        types.submodule {
          options = {
            command = mkOption {
              type = types.str;
              example = literalExpression ''"''${pkgs.mcp-server-git}/bin/mcp-server-git"'';
              description = "The stdio MCP server's program (a store path, or a name on the service's PATH).";
            };
            args = mkOption {
              type = types.listOf types.str;
              default = [ ];
              description = "Its arguments.";
            };
            environment = mkOption {
              type = types.attrsOf types.str;
              default = { };
              description = "Environment variables (not secrets: they end up in the Nix store).";
            };
            credentials = mkOption {
              type = types.attrsOf (
                types.addCheck types.str (p: lib.hasPrefix "/" p && !inStore p)
                // {
                  description = "absolute path outside the Nix store";
                }
              );
              default = { };
              example = {
                GITHUB_TOKEN = "/run/secrets/github-token";
              };
              description = ''
                Secret environment variables: each NAME = PATH is handed to the server's
                service with `LoadCredential` and exported as NAME when the server starts;
                the daemon and the agents never see it.
              '';
            };
            user = mkOption {
              type = types.nullOr types.str;
              default = null;
              description = "null: a user of its own for each run (DynamicUser); or a user that exists, e.g. one that owns the files the server works on.";
            };
            network = mkOption {
              type = types.bool;
              default = false;
              description = "Let the server reach the network (IPv4 and IPv6). Off: no network at all (PrivateNetwork).";
            };
            readWritePaths = mkOption {
              type = types.listOf types.str;
              default = [ ];
              description = "Folders the server may change (everything else is read-only or hidden: ProtectSystem=strict, ProtectHome).";
            };
            readOnlyPaths = mkOption {
              type = types.listOf types.str;
              default = [ ];
              description = "Folders made read-only for the server.";
            };
            workingDirectory = mkOption {
              type = types.nullOr types.str;
              default = null;
              description = "Its working directory.";
            };
            serviceConfig = mkOption {
              type = types.attrsOf types.anything;
              default = { };
              description = "Settings for the server's service unit, over the sandboxing mdclaw gives it.";
            };
          };
        }
      );
      default = { };
      example = literalExpression ''
        {
          git = {
            command = "''${pkgs.mcp-server-git}/bin/mcp-server-git";
            args = [ "--repository" "/srv/notes" ];
            readWritePaths = [ "/srv/notes" ];
            user = "notes";
          };
        }
      '';
      description = ''
        Stdio MCP servers run as sandboxed services of their own instead of as the daemon's
        children: each gets a socket, /run/mdclaw-mcp/NAME.sock (only the mdclaw user may
        connect), and systemd starts the server for the daemon's connection with it as its
        stdin and stdout. `settings.mcp_servers.NAME.socket` is set to it; the other keys
        there (timeout, max_result_bytes, approve...) still apply, and `settings.groups.*.mcp`
        says which groups get which tools (docs/mcp.md).
      '';
    };

    checkConfig = mkOption {
      type = types.bool;
      default = true;
      description = "Validate the rendered config with `mdclaw check-config` when it is built.";
    };

    watchdogSec = mkOption {
      type = types.ints.positive;
      default = 60;
      description = ''
        systemd watchdog timeout in seconds. The daemon pings at half of it, only from event
        loop iterations that made progress; a hung daemon is restarted.
      '';
    };

    renderedSettings = mkOption {
      type = types.attrs;
      readOnly = true;
      internal = true;
      default = renderedSettings;
      description = "The settings as written to config.yaml (unset keys left out).";
    };

    backup = {
      enable = mkEnableOption "a scheduled `mdclaw backup` of the database, group folders, agent sessions, WhatsApp session and config (taken while the daemon runs; docs/backup.md)";
      startAt = mkOption {
        type = types.either types.str (types.listOf types.str);
        default = "daily";
        example = "*-*-* 03:30:00";
        description = "When to back up: systemd calendar events (systemd.time(7)). A missed run is made up after boot (Persistent=true).";
      };
      directory = mkOption {
        type = types.str;
        default = "/var/backup/mdclaw";
        description = "Where the archives go (made 0700, owned by mdclaw). Put it on another disk, or copy it off the machine.";
      };
      keep = mkOption {
        type = types.ints.positive;
        default = 14;
        description = "How many archives to keep in `directory`; older ones are removed after each successful backup.";
      };
      ageRecipientFile = mkOption {
        type = types.nullOr types.path;
        default = null;
        example = "/etc/mdclaw/backup-recipients.txt";
        description = "Encrypt each archive to the age recipients in this file (`age1...` or `ssh-...`, one a line: public keys, so the file may be in the Nix store). Needs mdclaw built with the `age` extra (pyrage), which the flake's package lacks: nixpkgs has no pyrage.";
      };
      expectEvery = mkOption {
        type = types.nullOr types.str;
        default = backupPeriods.${toString cfg.backup.startAt} or null;
        defaultText = literalExpression "\"1h\", \"1d\", \"7d\" or \"30d\" for startAt hourly, daily, weekly, monthly; else null";
        example = "12h";
        description = "How often `startAt` fires, as an mdclaw duration: `mdclaw doctor` and the operator page warn once two backups are missed. null: the age of the last backup is shown, with no warning.";
      };
    };

    configFile = mkOption {
      type = types.path;
      readOnly = true;
      default = configFile;
      defaultText = literalExpression "the validated config file";
      description = "The validated config.yaml (read only; also at ${configPath}).";
    };
  };

  meta = {
    # Nobody from nixpkgs' maintainer list yet: whoever upstreams the module adds themselves.
    maintainers = [ ];
    doc = ../docs/nixos.md;
  };

  config = mkIf cfg.enable (lib.mkMerge [ mcpConfig {
    assertions = [
      {
        assertion = dataDirProblem == null;
        message = "services.mdclaw.settings.data_dir = \"${toString dataDir}\" ${
          if dataDirProblem == null then "" else dataDirProblem
        }. Give mdclaw a folder of its own, e.g. settings.data_dir = \"/var/lib/mdclaw\" (the default) or \"/srv/mdclaw\".";
      }
      {
        assertion = !(cfg.containerEngine == "podman" && (podmanCfg.dockerSocket.enable or false) && (dockerCfg.enable or false));
        message = "services.mdclaw.containerEngine = \"podman\": mdclaw talks to /run/podman/podman.sock and needs no /run/docker.sock, but virtualisation.podman.dockerSocket.enable makes Podman claim /run/docker.sock, which dockerd (virtualisation.docker.enable) owns. Turn virtualisation.podman.dockerSocket.enable off, or set services.mdclaw.containerEngine = \"docker\".";
      }
      {
        assertion = !(cfg.containerEngine == "docker" && (podmanCfg.dockerSocket.enable or false));
        message = "services.mdclaw.containerEngine = \"docker\" talks to dockerd at /run/docker.sock, which virtualisation.podman.dockerSocket.enable hands to Podman instead. Turn virtualisation.podman.dockerSocket.enable off, or set services.mdclaw.containerEngine = \"podman\".";
      }
      {
        assertion = !(cfg.containerEngine == "docker" && (podmanCfg.dockerCompat or false));
        message = "services.mdclaw.containerEngine = \"docker\" with virtualisation.podman.dockerCompat: the `docker` command would be Podman's. Turn virtualisation.podman.dockerCompat off, or set services.mdclaw.containerEngine = \"podman\".";
      }
      {
        assertion = !(usesClaude && cfg.image != null && !builtins.elem "claude" imageBackends);
        message = "services.mdclaw: settings.models.${lib.concatStringsSep ", " claudeModels} use backend \"claude\", but services.mdclaw.image holds only the ${lib.concatStringsSep ", " imageBackends} backend. Use the Claude image: services.mdclaw.image = mdclaw.packages.\${system}.container-image-claude (it holds claude-code, which is unfree).";
      }
      {
        assertion = cfg.image == null || !builtins.elem "claude" imageBackends || (cfg.image.mdclawClaudeCodeAllowed or true);
        message = "services.mdclaw.image is the Claude image from your nixpkgs (the overlay's mdclaw-agent-image-claude), which needs claude-code, an unfree package your nixpkgs does not allow. Accept its licence for that one package: nixpkgs.config.allowUnfreePredicate = pkg: builtins.elem (lib.getName pkg) [ \"claude-code\" ]; or use the flake's own mdclaw.packages.\${system}.container-image-claude.";
      }
      {
        assertion = !cfg.openFirewall || (webPort != 0 && !webLoopback);
        message = "services.mdclaw.openFirewall opens the web server's port, but ${listenKey} = \"${webListen}\" listens on loopback only. Set settings.server.listen = \"0.0.0.0:${toString (if webPort == 0 then 3000 else webPort)}\", or leave openFirewall off.";
      }
      {
        assertion = !cfg.openFirewall || webHasToken;
        message = "services.mdclaw.openFirewall would let the network use the operator page and post to the local HTTP channel without a token: keep settings.server.generate_secret = true (the default) or set settings.server.secret_file.";
      }
      {
        assertion = lib.all folderOk (lib.attrNames groups);
        message = "services.mdclaw.settings.groups: group names are folder names: 1-64 letters, digits, '_' or '-', starting with a letter or digit, not 'global' or 'errors' (got ${
          lib.concatStringsSep ", " (builtins.filter (n: !folderOk n) (lib.attrNames groups))
        }).";
      }
      {
        assertion = groups == { } || builtins.length mainGroups == 1;
        message = "services.mdclaw.settings.groups: exactly one group must have main = true; found ${toString (builtins.length mainGroups)}${
          lib.optionalString (mainGroups != [ ]) " (${lib.concatStringsSep ", " mainGroups})"
        }.";
      }
      {
        assertion = lib.all (u: builtins.elem u.model modelNames) usedModels;
        message = "services.mdclaw.settings: ${
          lib.concatMapStringsSep "; " (u: "${u.where} = \"${u.model}\" is not in settings.models") (
            builtins.filter (u: !builtins.elem u.model modelNames) usedModels
          )
        }.";
      }
      {
        assertion = lib.all (n: builtins.match "[A-Za-z0-9_.-]+" n != null) (lib.attrNames cfg.credentials);
        message = "services.mdclaw.credentials: names may hold only letters, digits, '_', '.' and '-' (they become file names under $CREDENTIALS_DIRECTORY).";
      }
      {
        assertion = !lib.any (s: inStore s.value) secretPaths;
        message = "services.mdclaw.settings: secret files must not be in the Nix store (world-readable): ${
          lib.concatMapStringsSep ", " (s: s.key) (builtins.filter (s: inStore s.value) secretPaths)
        }. Use services.mdclaw.credentials and \"$CREDENTIALS_DIRECTORY/NAME\".";
      }
      {
        assertion = lib.all mcpNameOk (lib.attrNames cfg.mcpServers);
        message = "services.mdclaw.mcpServers: names are MCP server names: lower-case letters and digits, single '-' or '_' between them, at most 32 characters (got ${
          lib.concatStringsSep ", " (builtins.filter (n: !mcpNameOk n) (lib.attrNames cfg.mcpServers))
        }).";
      }
      {
        assertion = lib.all (
          n: (cfg.settings.mcp_servers.${n}.command or null) == null && (cfg.settings.mcp_servers.${n}.url or null) == null
        ) (lib.attrNames cfg.mcpServers);
        message = "services.mdclaw.mcpServers runs ${lib.concatStringsSep ", " (lib.attrNames cfg.mcpServers)} as services of their own; leave settings.mcp_servers.<name>.command and .url unset for them (the module sets .socket).";
      }
      {
        assertion = lib.all (s: lib.all (n: builtins.match "[A-Za-z_][A-Za-z0-9_]*" n != null) (lib.attrNames s.credentials)) (lib.attrValues cfg.mcpServers);
        message = "services.mdclaw.mcpServers.<name>.credentials: names are environment variable names (letters, digits, '_').";
      }
      {
        assertion = cfg.settings.runtime.engine == cfg.containerEngine;
        message = "services.mdclaw.settings.runtime.engine (${cfg.settings.runtime.engine}) differs from services.mdclaw.containerEngine (${cfg.containerEngine}); set containerEngine instead.";
      }
      {
        assertion = cfg.settings.runtime.image != null;
        message = "services.mdclaw: set services.mdclaw.image (the flake's container-image) or settings.runtime.image.";
      }
    ];

    services.mdclaw.settings = {
      data_dir = mkDefault "/var/lib/mdclaw";
      # No other local user may post to the loopback chat as the main group, or use the
      # operator page: a token is made on first start (data_dir/http-secret, 0600);
      # `sudo mdclaw http-token` shows it. (A secret_file wins over it; with the token's old
      # names under channels.http the user's choice stands alone.)
      server.generate_secret = mkIf (!oldTokenKeysSet) (mkDefault true);
      mcp_servers = lib.mapAttrs (name: _: { socket = mkDefault (mcpSocket name); }) cfg.mcpServers;
      runtime = {
        engine = mkDefault cfg.containerEngine;
        socket = mkDefault "unix://${eng.socket}";
        image = mkIf (cfg.image != null) (mkDefault "${cfg.image.imageName}:${cfg.image.imageTag}");
      };
    };

    # mdclaw uses Podman's own socket; /run/docker.sock is left to whoever wants it.
    virtualisation.podman.enable = mkIf (cfg.containerEngine == "podman") true;
    virtualisation.docker.enable = mkIf (cfg.containerEngine == "docker") true;

    networking.firewall.allowedTCPPorts = lib.optional (cfg.openFirewall && webPort != 0) webPort;

    users.users.mdclaw = {
      isSystemUser = true;
      group = "mdclaw";
      home = dataDir;
      description = "mdclaw daemon";
    };
    users.groups.mdclaw = { };

    environment.etc."mdclaw/config.yaml".source = configFile;
    # `sudo mdclaw <anything>` as the service; `mdclaw status` ... for the mdclaw group.
    environment.systemPackages = [ adminCli ];

    systemd.tmpfiles.rules =
      lib.optional (!dataDirIsStateDir) "d '${dataDir}' 0750 mdclaw mdclaw - -"
      ++ lib.optional bk.enable "d '${bk.directory}' 0700 mdclaw mdclaw - -";

    # The backup: a oneshot as the service's user (it reads data_dir while the daemon runs:
    # SQLite's online backup API) and its timer.
    systemd.services.mdclaw-backup = mkIf bk.enable {
      description = "Back up mdclaw's data (mdclaw backup)";
      after = [ "mdclaw.service" ];
      environment = {
        MDCLAW_CONFIG = configPath;
        TMPDIR = "/run/mdclaw-backup";
      };
      serviceConfig = hardening // {
        Type = "oneshot";
        ExecStart = "${exe} ${backupArgs}";
        ReadWritePaths = [
          dataDir
          bk.directory
        ];
        RuntimeDirectory = "mdclaw-backup";
        RuntimeDirectoryMode = "0700";
        WorkingDirectory = dataDir;
        LoadCredential = credentialSpecs;
        Nice = 10;
        IOSchedulingClass = "idle";
      };
    };
    systemd.timers.mdclaw-backup = mkIf bk.enable {
      description = "Back up mdclaw's data on schedule";
      wantedBy = [ "timers.target" ];
      timerConfig = {
        OnCalendar = bk.startAt;
        Persistent = true;
        RandomizedDelaySec = "5min";
      };
    };

    systemd.services.mdclaw-image = mkIf (cfg.image != null) {
      description = "Load mdclaw's agent image into the container engine";
      requiredBy = [ "mdclaw.service" ];
      before = [ "mdclaw.service" ];
      requires = [ eng.unit ];
      after = [ eng.unit ];
      environment = {
        MDCLAW_CONFIG = configPath;
        TMPDIR = "/run/mdclaw-image";
      };
      serviceConfig = hardening // {
        Type = "oneshot";
        RemainAfterExit = true;
        # Skipped in seconds when the engine has this exact image; a first load of a new
        # image through the engine's API can take minutes on small machines.
        ExecStart = "${exe} image load ${cfg.image}";
        TimeoutStartSec = "15min";
        RuntimeDirectory = "mdclaw-image";
        RuntimeDirectoryMode = "0750";
      };
    };

    systemd.services.mdclaw = {
      description = "mdclaw AI assistant host";
      wantedBy = [ "multi-user.target" ];
      wants = [ "network-online.target" ] ++ map (n: "mdclaw-mcp-${n}.socket") (lib.attrNames cfg.mcpServers);
      requires = [ eng.unit ] ++ lib.optional (cfg.image != null) "mdclaw-image.service";
      after = [
        "network-online.target"
        eng.unit
      ]
      ++ lib.optional (cfg.image != null) "mdclaw-image.service"
      ++ map (n: "mdclaw-mcp-${n}.socket") (lib.attrNames cfg.mcpServers);
      # Only the config changed: reload (SIGHUP re-reads and reconciles, keeps the old config
      # running if the new one is bad). Package or unit changes restart.
      reloadTriggers = [ configFile ];
      environment = {
        MDCLAW_CONFIG = configPath;
        PYTHONUNBUFFERED = "1";
        # /tmp is read-only under ProtectSystem=strict (and must not be private, see below).
        TMPDIR = "/run/mdclaw";
      };
      serviceConfig = hardening // {
        Type = "notify";
        NotifyAccess = "main";
        ExecStart = "${exe} run --config ${configPath}";
        ExecReload = "${pkgs.coreutils}/bin/kill -HUP $MAINPID";
        Restart = "on-failure";
        RestartSec = "5s";
        WatchdogSec = "${toString cfg.watchdogSec}s";
        # The image is loaded before (mdclaw-image.service); start to READY=1 measured at
        # about 6 s on a busy 2-core machine (docs/performance.md): 90 s leaves room.
        TimeoutStartSec = "90s";
        # SIGTERM drains for up to 30 s (closing conversations, stopping containers).
        TimeoutStopSec = "45s";

        StateDirectory = lib.optional dataDirIsStateDir stateDirName;
        StateDirectoryMode = "0750";
        RuntimeDirectory = "mdclaw";
        RuntimeDirectoryMode = "0750";
        ReadWritePaths = lib.optional (!dataDirIsStateDir) dataDir;
        WorkingDirectory = dataDir;
        LoadCredential = credentialSpecs;
      };
    };
  } ]);
}
