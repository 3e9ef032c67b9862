# A stand-in for nixpkgs' top level, just enough to evaluate flake.nix's outputs where nixpkgs
# cannot be fetched. Builders return attribute sets that record their arguments, so tests can
# check what the flake asks for (package names, test settings, the image's config) without
# building anything. nixpkgs' real `lib` comes from $NIXPKGS_LIB.
#
# The python package names below were checked against nixpkgs; a requirement that is not
# here makes the flake test fail until its nixpkgs attribute name has been checked and added.
{
  system,
  overlays ? [ ],
  config ? { },
}:
let
  lib = import (builtins.getEnv "NIXPKGS_LIB" + "/lib");

  drv =
    name: attrs:
    {
      type = "derivation";
      inherit name;
      outPath = "${builtins.storeDir}/00000000000000000000000000000000-${name}";
      meta = { };
    }
    // attrs;

  pythonNames = [
    "aiohttp"
    "aiosmtpd"
    "claude-agent-sdk"
    "croniter"
    "discordpy"
    "docker"
    "hypothesis"
    "imapclient"
    "inotify-simple"
    "jsonschema"
    "markdown-it-py"
    "markdownify"
    "matrix-nio"
    "nh3"
    "prometheus-client"
    "pydantic"
    "pydantic-settings"
    "pytest-timeout"
    "pytestCheckHook"
    "pywebpush"
    "pyyaml"
    "sdnotify"
    "segno"
    "setuptools"
    "slack-bolt"
    "slack-sdk"
    "tzdata"
    "zstandard"
  ];

  # FAKE_NIXPKGS_WITHOUT="a b": pretend nixpkgs lacks these python packages.
  missing = lib.splitString " " (builtins.getEnv "FAKE_NIXPKGS_WITHOUT");
  pythonPackages = lib.genAttrs (lib.subtractLists missing pythonNames) (n: drv "python3.12-${n}" { }) // {
    buildPythonApplication =
      args:
      drv "${args.pname}-${args.version}" {
        inherit args;
        meta = args.meta or { };
      };
    buildPythonPackage = args: drv "python3.12-${args.pname}-${args.version}" { inherit args; };
    callPackage = f: extra: f (builtins.intersectAttrs (lib.functionArgs f) pythonPackages // extra);
  };

  base = final: {
    inherit lib system config;
    python3Packages = pythonPackages;
    python3 = drv "python3-3.12" {
      withPackages = f: drv "python3-3.12-env" { packages = f pythonPackages; };
    };
    dockerTools.buildLayeredImage =
      args:
      drv "${args.name}.tar.gz" {
        inherit args;
        imageName = args.name;
        imageTag = if args.tag or null == null then "0123456789abcdef" else args.tag;
      };
    runCommand =
      name: env: script:
      drv name { inherit env script; };
    mkShell = args: drv "nix-shell" { inherit args; };
    testers.runNixOSTest = args: drv "vm-test-run-${args.name}" { inherit args; };
    stdenv.hostPlatform.system = system;
    cacert = drv "nss-cacert-3.101" { };
    tzdata = drv "tzdata-2025b" { };
    bashInteractive = drv "bash-interactive-5.2" { };
    coreutils = drv "coreutils-9.5" { };
    # Unfree, as in nixpkgs: evaluating its outPath (any build that holds it) fails unless the
    # config allows it, with nixpkgs' own words. Its name stays readable (for predicates).
    claude-code =
      let
        allowed = (config.allowUnfree or false) || (config.allowUnfreePredicate or (_: false)) {
          name = "claude-code-2.0.0";
          pname = "claude-code";
        };
      in
      drv "claude-code-2.0.0" {
        pname = "claude-code";
        meta.license.free = false;
      }
      // lib.optionalAttrs (!allowed) {
        outPath = throw "Package ‘claude-code-2.0.0’ has an unfree license (‘unfree’), refusing to evaluate.";
      };
    nixfmt = drv "nixfmt-1.0.0" { };
    podman = drv "podman-5.4.0" { };
    gnumake = drv "gnumake-4.4.1" { };
  };
in
lib.fix (builtins.foldl' (acc: overlay: lib.extends overlay acc) base overlays)
