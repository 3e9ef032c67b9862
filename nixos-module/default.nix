# services.mdclaw: the mdclaw daemon as a hardened systemd service.
#
# - `settings` is config.yaml as Nix; every key is a typed option made from mdclaw's own config
#   schema (settings-options.nix), and the rendered file is validated with `mdclaw check-config`
#   when it is built, so a bad config never reaches the running service.
# - Secrets stay out of the Nix store: `credentials` hands files to the service with systemd's
#   LoadCredential, and settings point at them as "$CREDENTIALS_DIRECTORY/<name>".
# - The agent image from the flake is loaded into the engine before the daemon starts.
# - The config lives at /etc/mdclaw/config.yaml: changing only settings reloads the daemon
#   (SIGHUP) instead of restarting it; a new package or image restarts it.
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
        else if lib.hasSuffix "_file" (lib.last ([ "" ] ++ path)) && builtins.isString v then
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
      default = pkgs.mdclaw-agent-image or null;
      defaultText = literalExpression "mdclaw.packages.\${system}.container-image";
      description = ''
        The agent image (the flake's `container-image`, a docker-archive tarball), loaded
        into the container engine with `mdclaw image load` before the daemon starts.
        `settings.runtime.image` defaults to its name and tag, so an upgrade switches the
        agents to the new image. Null: manage the image yourself (`mdclaw image build`) and
        set `settings.runtime.image`.
      '';
    };

    containerEngine = mkOption {
      type = types.enum [
        "podman"
        "docker"
      ];
      default = "podman";
      description = ''
        The engine that runs the agent containers. `podman` enables Podman with its
        Docker-compatible API socket (`virtualisation.podman.dockerSocket.enable`); `docker`
        enables dockerd. Either way the `mdclaw` user joins the engine's socket group, which
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

    configFile = mkOption {
      type = types.path;
      readOnly = true;
      default = configFile;
      defaultText = literalExpression "the validated config file";
      description = "The validated config.yaml (read only; also at ${configPath}).";
    };
  };

  config = mkIf cfg.enable {
    assertions = [
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
      runtime = {
        engine = mkDefault cfg.containerEngine;
        socket = mkDefault "unix://${eng.socket}";
        image = mkIf (cfg.image != null) (mkDefault "${cfg.image.imageName}:${cfg.image.imageTag}");
      };
    };

    virtualisation.podman = mkIf (cfg.containerEngine == "podman") {
      enable = true;
      dockerSocket.enable = mkDefault true;
    };
    virtualisation.docker.enable = mkIf (cfg.containerEngine == "docker") true;

    users.users.mdclaw = {
      isSystemUser = true;
      group = "mdclaw";
      home = dataDir;
      description = "mdclaw daemon";
    };
    users.groups.mdclaw = { };

    environment.etc."mdclaw/config.yaml".source = configFile;
    # `mdclaw status`, `mdclaw reconcile --dry-run` ... for the administrator.
    environment.systemPackages = [ cfg.package ];

    systemd.tmpfiles.rules = lib.optional (!dataDirIsStateDir) "d '${dataDir}' 0750 mdclaw mdclaw - -";

    systemd.services.mdclaw = {
      description = "mdclaw AI assistant host";
      wantedBy = [ "multi-user.target" ];
      wants = [ "network-online.target" ];
      requires = [ eng.unit ];
      after = [
        "network-online.target"
        eng.unit
      ];
      # Only the config changed: reload (SIGHUP re-reads and reconciles, keeps the old config
      # running if the new one is bad). Package, image or unit changes restart.
      reloadTriggers = [ configFile ];
      environment = {
        MDCLAW_CONFIG = configPath;
        PYTHONUNBUFFERED = "1";
        # /tmp is read-only under ProtectSystem=strict (and must not be private, see below).
        TMPDIR = "/run/mdclaw";
      };
      serviceConfig = {
        Type = "notify";
        NotifyAccess = "main";
        ExecStartPre = lib.optional (cfg.image != null) "${exe} image load ${cfg.image}";
        ExecStart = "${exe} run --config ${configPath}";
        ExecReload = "${pkgs.coreutils}/bin/kill -HUP $MAINPID";
        Restart = "on-failure";
        RestartSec = "5s";
        WatchdogSec = "${toString cfg.watchdogSec}s";
        # Loading a large image on first start can take a while.
        TimeoutStartSec = "10min";
        # SIGTERM drains for up to 30 s (closing conversations, stopping containers).
        TimeoutStopSec = "45s";

        User = "mdclaw";
        Group = "mdclaw";
        SupplementaryGroups = [ eng.group ];
        StateDirectory = lib.optional dataDirIsStateDir stateDirName;
        StateDirectoryMode = "0750";
        RuntimeDirectory = "mdclaw";
        RuntimeDirectoryMode = "0750";
        ReadWritePaths = lib.optional (!dataDirIsStateDir) dataDir;
        WorkingDirectory = dataDir;
        LoadCredential = lib.mapAttrsToList (name: path: "${name}:${path}") cfg.credentials;
        UMask = "0027";

        # Hardening. The engine resolves bind mounts in its own mount namespace, so data_dir
        # (IPC and group folders) must be a real host path: no PrivateTmp, no temporary
        # filesystems over it.
        PrivateTmp = false;
        ProtectSystem = "strict";
        ProtectHome = if needsHome then "read-only" else true;
        NoNewPrivileges = true;
        PrivateDevices = true;
        ProtectKernelTunables = true;
        ProtectKernelModules = true;
        ProtectKernelLogs = true;
        ProtectControlGroups = true;
        ProtectClock = true;
        ProtectHostname = true;
        ProtectProc = "invisible";
        ProcSubset = "pid";
        RestrictAddressFamilies = [
          "AF_UNIX"
          "AF_INET"
          "AF_INET6"
          "AF_NETLINK"
        ];
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
    };
  };
}
