# Evaluates nixos-module/ with nixpkgs' lib alone (the nix-community/nixpkgs.lib checkout),
# for machines that cannot fetch nixpkgs. The few things the module takes from pkgs are
# stubbed; the NixOS options it sets are declared here as nixpkgs declares them, strictly (no
# freeform parts: a misspelt option such as `dockerSocket.enabled` or `reloadTrigger` fails as
# it would on NixOS), and the assertions of nixpkgs' podman, docker and users modules that the
# module can meet are modelled with nixpkgs' messages.
#
#   nix-instantiate --eval --strict --json tests/nix/eval-module.nix \
#     --arg nixpkgsLib /path/to/nixpkgs.lib --arg configuration ./case.nix
#
# `configuration` is a NixOS-style module setting services.mdclaw. Failed assertions abort
# the evaluation with their messages, as nixos-rebuild does. `allowClaudeCode`: whether the
# stub nixpkgs allows the unfree claude-code (for the overlay's Claude image).
{
  nixpkgsLib,
  configuration,
  allowClaudeCode ? false,
}:
let
  lib = import (nixpkgsLib + "/lib");
  inherit (lib) types mkOption;

  fakeDrv =
    name: attrs:
    {
      type = "derivation";
      inherit name;
      outPath = "${builtins.storeDir}/0000000000000000000000000000000${toString (builtins.stringLength name)}-${name}";
    }
    // attrs;

  # pkgs.formats.yaml: a JSON value type (JSON is YAML) and a generator.
  yamlValue =
    let
      valueType =
        types.nullOr (
          types.oneOf [
            types.bool
            types.int
            types.float
            types.str
            types.path
            (types.attrsOf valueType)
            (types.listOf valueType)
          ]
        )
        // {
          description = "YAML value";
        };
    in
    valueType;

  pkgs = {
    formats.yaml = _: {
      type = yamlValue;
      generate = name: value: fakeDrv name { json = builtins.toJSON value; };
    };
    runCommand = name: env: script: fakeDrv name { inherit env script; };
    coreutils = fakeDrv "coreutils-9.5" { };
    tzdata = fakeDrv "tzdata-2025b" { };
    mdclaw = fakeDrv "mdclaw-0.1.0" { meta.mainProgram = "mdclaw"; };
    mdclaw-agent-image = fakeDrv "mdclaw-agent.tar.gz" {
      imageName = "mdclaw-agent";
      imageTag = "0123abcd";
      mdclawBackends = [ "openai" ];
      mdclawClaudeCodeAllowed = true;
    };
    mdclaw-agent-image-claude = fakeDrv "mdclaw-agent.tar.gz" {
      imageName = "mdclaw-agent";
      imageTag = "c1a0de00";
      mdclawBackends = [
        "openai"
        "claude"
      ];
      mdclawClaudeCodeAllowed = allowClaudeCode;
    };
    writeShellScriptBin = name: text: fakeDrv name { inherit text; };
    writeShellScript = name: text: fakeDrv name { inherit text; };
  };

  inherit (types)
    bool
    str
    listOf
    attrsOf
    nullOr
    submodule
    package
    ;
  opt =
    type: default:
    mkOption {
      inherit type default;
    };
  # What NixOS accepts as a unit setting (systemd-lib's unitOption): scalars or lists of them.
  unitScalar = types.oneOf [
    types.bool
    types.int
    types.str
    types.path
    types.package
  ];
  unitOption = types.either unitScalar (listOf unitScalar);
  unitNames = opt (listOf str) [ ];

  nixosStubs =
    { config, ... }:
    {
      options = {
        assertions = opt (listOf (submodule {
          options = {
            assertion = mkOption { type = bool; };
            message = mkOption { type = str; };
          };
        })) [ ];
        warnings = opt (listOf str) [ ];
        meta = {
          maintainers = opt (listOf types.raw) [ ];
          doc = opt (nullOr types.path) null;
        };
        nixpkgs.config = opt types.attrs { };
        users.users = opt (attrsOf (
          submodule (
            { name, config, ... }:
            {
              # config/users-groups.nix: a normal user's group defaults to "users"
              config.group = lib.mkIf config.isNormalUser (lib.mkDefault "users");
              options = {
                name = opt str name;
                isSystemUser = opt bool false;
                isNormalUser = opt bool false;
                group = opt str "";
                extraGroups = opt (listOf str) [ ];
                home = opt str "/var/empty";
                createHome = opt bool false;
                description = opt str "";
                uid = opt (nullOr types.int) null;
              };
            }
          )
        )) { };
        users.groups = opt (attrsOf (submodule {
          options = {
            gid = opt (nullOr types.int) null;
            members = opt (listOf str) [ ];
          };
        })) { };
        environment.etc = opt (attrsOf (submodule {
          options = {
            enable = opt bool true;
            source = opt (nullOr types.path) null;
            text = opt (nullOr types.lines) null;
            mode = opt str "symlink";
            user = opt str "+0";
            group = opt str "+0";
          };
        })) { };
        environment.systemPackages = opt (listOf package) [ ];
        networking.firewall = {
          enable = opt bool true;
          allowedTCPPorts = opt (listOf types.port) [ ];
          allowedUDPPorts = opt (listOf types.port) [ ];
        };
        systemd.package = opt package (fakeDrv "systemd-257.5" { });
        systemd.tmpfiles.rules = opt (listOf str) [ ];
        systemd.services = opt (attrsOf (submodule {
          options = {
            enable = opt bool true;
            description = opt str "";
            wantedBy = unitNames;
            requiredBy = unitNames;
            wants = unitNames;
            requires = unitNames;
            after = unitNames;
            before = unitNames;
            bindsTo = unitNames;
            partOf = unitNames;
            conflicts = unitNames;
            upholds = unitNames;
            reloadTriggers = opt (listOf unitOption) [ ];
            restartTriggers = opt (listOf unitOption) [ ];
            restartIfChanged = opt bool true;
            reloadIfChanged = opt bool false;
            stopIfChanged = opt bool true;
            environment = opt (attrsOf (nullOr (types.oneOf [
              str
              types.path
              package
            ]))) { };
            path = opt (listOf (types.either package str)) [ ];
            serviceConfig = opt (attrsOf unitOption) { };
            unitConfig = opt (attrsOf unitOption) { };
            startLimitIntervalSec = opt (nullOr types.int) null;
            startLimitBurst = opt (nullOr types.int) null;
            script = opt types.lines "";
            preStart = opt types.lines "";
            postStart = opt types.lines "";
            startAt = opt (types.either str (listOf str)) [ ];
          };
        })) { };
        systemd.timers = opt (attrsOf (submodule {
          options = {
            enable = opt bool true;
            description = opt str "";
            wantedBy = unitNames;
            requiredBy = unitNames;
            partOf = unitNames;
            timerConfig = opt (attrsOf unitOption) { };
            unitConfig = opt (attrsOf unitOption) { };
          };
        })) { };
        systemd.sockets = opt (attrsOf (submodule {
          options = {
            enable = opt bool true;
            description = opt str "";
            wantedBy = unitNames;
            listenStreams = opt (listOf str) [ ];
            socketConfig = opt (attrsOf unitOption) { };
          };
        })) { };
        virtualisation.podman = {
          enable = opt bool false;
          dockerSocket.enable = opt bool false;
          dockerCompat = opt bool false;
          extraPackages = opt (listOf package) [ ];
          autoPrune = {
            enable = opt bool false;
            flags = opt (listOf str) [ ];
            dates = opt str "weekly";
          };
          defaultNetwork.settings = opt types.attrs { };
        };
        virtualisation.docker = {
          enable = opt bool false;
          enableOnBoot = opt bool true;
          listenOptions = opt (listOf str) [ "/run/docker.sock" ];
          daemon.settings = opt types.attrs { };
          rootless.enable = opt bool false;
          autoPrune.enable = opt bool false;
          storageDriver = opt (nullOr str) null;
        };
      };

      # What nixpkgs' modules add and assert, where the module can meet it.
      config = {
        # virtualisation/podman: its socket group; only one engine serves /run/docker.sock.
        users.groups = lib.mkMerge [
          (lib.mkIf config.virtualisation.podman.enable { podman = { }; })
          (lib.mkIf config.virtualisation.docker.enable { docker = { }; })
        ];
        assertions =
          lib.optionals config.virtualisation.podman.enable [
            {
              assertion = config.virtualisation.podman.dockerCompat -> !config.virtualisation.docker.enable;
              message = "Option dockerCompat conflicts with docker";
            }
            {
              assertion = config.virtualisation.podman.dockerSocket.enable -> !config.virtualisation.docker.enable;
              message = "The options virtualisation.podman.dockerSocket.enable and virtualisation.docker.enable conflict, because only one can serve the socket.";
            }
          ]
          # config/users-groups.nix
          ++ lib.concatLists (
            lib.mapAttrsToList (name: u: [
              {
                assertion = u.isSystemUser != u.isNormalUser;
                message = "Exactly one of users.users.${name}.isSystemUser and users.users.${name}.isNormalUser must be set.";
              }
              {
                assertion = u.group != "";
                message = "users.users.${name}.group is unset. This used to default to nogroup, but this is unsafe.";
              }
            ]) config.users.users
          );
      };
    };

  eval = lib.evalModules {
    modules = [
      nixosStubs
      ../../nixos-module
      configuration
      { _module.args.pkgs = pkgs; }
    ];
  };
  inherit (eval) config;
  cfg = config.services.mdclaw;

  failed = map (a: a.message) (builtins.filter (a: !a.assertion) config.assertions);

  settingsDocs = builtins.listToAttrs (
    map (o: {
      name = lib.removePrefix "services.mdclaw.settings." o.name;
      value = {
        inherit (o) type;
        description = o.description or "";
      };
    }) (builtins.filter (
      o: lib.hasPrefix "services.mdclaw.settings." o.name && o.visible && !o.internal
    ) (lib.optionAttrSetToDocList eval.options))
  );
in
if failed != [ ] then
  throw "Failed assertions:\n- ${lib.concatStringsSep "\n- " failed}"
else
  {
    enabled = cfg.enable;
    settings = cfg.renderedSettings;
    configFile = {
      inherit (cfg.configFile) name;
      script = cfg.configFile.script or null;
      env = cfg.configFile.env or null;
    };
    etc = lib.mapAttrs (_: e: toString e.source) config.environment.etc;
    unit = config.systemd.services.mdclaw or null;
    imageUnit = config.systemd.services.mdclaw-image or null;
    backupUnit = config.systemd.services.mdclaw-backup or null;
    backupTimer = config.systemd.timers.mdclaw-backup or null;
    mcpSockets = config.systemd.sockets;
    mcpUnits = (lib.filterAttrs (n: _: lib.hasPrefix "mdclaw-mcp-" n) config.systemd.services);
    systemPackages = map (p: {
      inherit (p) name;
      text = p.text or null;
    }) config.environment.systemPackages;
    firewall = config.networking.firewall.allowedTCPPorts;
    meta = {
      maintainers = config.meta.maintainers;
      doc = toString config.meta.doc;
    };
    image = if cfg.image == null then null else cfg.image.imageTag;
    users = config.users.users;
    groups = lib.attrNames config.users.groups;
    tmpfiles = config.systemd.tmpfiles.rules;
    podman = config.virtualisation.podman;
    docker = config.virtualisation.docker;
    warnings = config.warnings;
    options = settingsDocs;
  }
