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
  module = outputs.nixosModules.default {
    inherit lib pkgs;
    config = { };
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
  image = {
    inherit (image) name imageName imageTag;
    inherit (image.args)
      created
      config
      extraCommands
      fakeRootCommands
      ;
    tag = image.args.tag or null;
    contents = names image.args.contents;
    python = names (builtins.head image.args.contents).packages;
  };
  lib = {
    inherit (outputs.lib) imageRequirements hostRequirements;
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
  };
}
