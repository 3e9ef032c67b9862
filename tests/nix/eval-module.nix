# Evaluates nixos-module/ with nixpkgs' lib alone (the nix-community/nixpkgs.lib checkout),
# for machines that cannot fetch nixpkgs. The few things the module takes from pkgs and the
# NixOS options it sets are stubbed here: the stubs declare options loosely (freeform), so
# what is checked is the module's own options, types, assertions and the values it produces.
#
#   nix-instantiate --eval --strict --json tests/nix/eval-module.nix \
#     --arg nixpkgsLib /path/to/nixpkgs.lib --arg configuration ./case.nix
#
# `configuration` is a NixOS-style module setting services.mdclaw. Failed assertions abort
# the evaluation with their messages, as nixos-rebuild does.
{
  nixpkgsLib,
  configuration,
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
    };
  };

  loose = types.attrsOf types.anything;
  # What NixOS accepts in serviceConfig (systemd unit values): scalars or lists of them.
  unitScalar = types.oneOf [
    types.bool
    types.int
    types.str
    types.path
  ];
  unitValues = types.attrsOf (types.either unitScalar (types.listOf unitScalar));
  looseSubmodule = types.submodule { freeformType = loose; };
  listOpt = mkOption {
    type = types.listOf types.anything;
    default = [ ];
  };

  nixosStubs = {
    options = {
      assertions = listOpt;
      warnings = listOpt;
      users.users = mkOption {
        type = types.attrsOf looseSubmodule;
        default = { };
      };
      users.groups = mkOption {
        type = types.attrsOf looseSubmodule;
        default = { };
      };
      environment.etc = mkOption {
        type = types.attrsOf looseSubmodule;
        default = { };
      };
      environment.systemPackages = listOpt;
      systemd.tmpfiles.rules = listOpt;
      systemd.services = mkOption {
        type = types.attrsOf (
          types.submodule {
            freeformType = loose;
            options = {
              serviceConfig = mkOption {
                type = unitValues;
                default = { };
              };
              environment = mkOption {
                type = types.attrsOf (types.nullOr unitScalar);
                default = { };
              };
              wantedBy = listOpt;
              wants = listOpt;
              requires = listOpt;
              after = listOpt;
              reloadTriggers = listOpt;
            };
          }
        );
        default = { };
      };
      virtualisation.podman = mkOption {
        type = looseSubmodule;
        default = { };
      };
      virtualisation.docker = mkOption {
        type = looseSubmodule;
        default = { };
      };
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
    users = config.users.users;
    groups = lib.attrNames config.users.groups;
    tmpfiles = config.systemd.tmpfiles.rules;
    podman = config.virtualisation.podman;
    docker = config.virtualisation.docker;
    warnings = config.warnings;
    options = settingsDocs;
  }
