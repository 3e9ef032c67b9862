# Evaluates flake.nix's outputs against tests/nix/fake-nixpkgs (nixpkgs' real lib, stub
# builders) and returns what the tests check, as JSON-friendly data. Run with NIXPKGS_LIB set:
#
#   NIXPKGS_LIB=/path/to/nixpkgs.lib nix-instantiate --eval --strict --json \
#     tests/nix/eval-flake.nix --arg nixpkgsLib /path/to/nixpkgs.lib
{ nixpkgsLib }:
let
  lib = import (nixpkgsLib + "/lib");
  flake = import ../../flake.nix;
  nixpkgs = {
    inherit lib;
    outPath = toString ./fake-nixpkgs;
  };
  self = outputs // {
    outPath = toString ../..;
  };
  outputs = flake.outputs { inherit self nixpkgs; };
  sys = "x86_64-linux";
  pkgs = import ./fake-nixpkgs { system = sys; };
  withOverlay = import ./fake-nixpkgs {
    system = sys;
    overlays = [ outputs.overlays.default ];
  };
  names = map (d: d.name);

  mdclaw = outputs.packages.${sys}.mdclaw;
  image = outputs.packages.${sys}.container-image;
  claudeImage = outputs.packages.${sys}.container-image-claude;
  moduleWith =
    models:
    outputs.nixosModules.default {
      inherit lib pkgs;
      config.services.mdclaw.settings.models = models;
    };
  module = moduleWith { };
  # What a build of the image needs: every store path in it (throws on a refused unfree one).
  buildInputsOf = img: map (d: d.outPath) (img.args.contents ++ (builtins.head img.args.contents).packages);
  describeImage = img: {
    inherit (img) name imageName imageTag;
    inherit (img.args)
      created
      config
      extraCommands
      fakeRootCommands
      ;
    tag = img.args.tag or null;
    contents = names img.args.contents;
    python = names (builtins.head img.args.contents).packages;
    backends = img.mdclawBackends;
    claudeCodeAllowed = img.mdclawClaudeCodeAllowed;
    builds = builtins.deepSeq (buildInputsOf img) true;
  };
in
{
  nixpkgsUrl = flake.inputs.nixpkgs.url;
  outputs = lib.attrNames outputs;
  systems = lib.mapAttrs (_: v: lib.attrNames v) {
    inherit (outputs)
      packages
      apps
      devShells
      formatter
      checks
      ;
  };
  packages = lib.attrNames outputs.packages.${sys};
  checks = lib.attrNames outputs.checks.${sys};
  defaultIsMdclaw = outputs.packages.${sys}.default.name == mdclaw.name;
  app = outputs.apps.${sys}.default;
  formatter = outputs.formatter.${sys}.name;
  devShellPackages = names outputs.devShells.${sys}.default.args.packages;
  overlayAttrs = lib.attrNames (outputs.overlays.default pkgs pkgs);
  mdclaw = {
    inherit (mdclaw) name;
    inherit (mdclaw.args)
      pname
      version
      pyproject
      disabledTestMarks
      disabledTestPaths
      pythonImportsCheck
      ;
    mainProgram = mdclaw.meta.mainProgram;
    buildSystem = names mdclaw.args.build-system;
    dependencies = names mdclaw.args.dependencies;
    checkInputs = names mdclaw.args.nativeCheckInputs;
  };
  agentRunner = {
    inherit (withOverlay.mdclaw-agent-runner.args) pname pyproject;
    dependencies = names withOverlay.mdclaw-agent-runner.args.dependencies;
  };
  image = describeImage image;
  claudeImage = describeImage claudeImage;
  # The overlay in a nixpkgs that does not allow claude-code: the free image builds, the
  # Claude image says (for the module's assertion) that it cannot.
  overlayClaudeAllowed = withOverlay.mdclaw-agent-image-claude.mdclawClaudeCodeAllowed;
  overlayFreeBuilds = builtins.deepSeq (buildInputsOf withOverlay.mdclaw-agent-image) true;
  overlayClaudeBuilds =
    (builtins.tryEval (builtins.deepSeq (buildInputsOf withOverlay.mdclaw-agent-image-claude) true))
    .success;
  lib = {
    inherit (outputs.lib)
      imageRequirements
      hostRequirements
      channelRequirements
      claudeRequirements
      ;
    parsed = outputs.lib.parseRequirements ''
      # the agent image
      inotify_simple>=1.3  # wake-ups
      claude-agent-sdk[extra] >= 0.2 ; python_version >= "3.11"
      -r other.txt
      --hash=sha256:abc
      Zope.Interface==6

    '';
  };
  vmTest = {
    inherit (outputs.checks.${sys}.nixos.args) name testScript;
  };
  nixosModule = {
    imports = map toString module.imports;
    package = module.services.mdclaw.package.content.name;
    packagePriority = module.services.mdclaw.package.priority;
    image = module.services.mdclaw.image.content.name;
    imageBackends = module.services.mdclaw.image.content.mdclawBackends;
    claudeImageBackends =
      (moduleWith {
        c = {
          backend = "claude";
        };
      }).services.mdclaw.image.content.mdclawBackends;
  };
}
