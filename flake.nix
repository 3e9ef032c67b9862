{
  description = "mdclaw: self-hosted personal AI assistant host";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.05";

  outputs = { self, nixpkgs }:
    let
      systems = [ "x86_64-linux" "aarch64-linux" ];
      forAllSystems = f: nixpkgs.lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system});
    in
    {
      packages = forAllSystems (pkgs: rec {
        mdclaw = pkgs.python3Packages.buildPythonApplication {
          pname = "mdclaw";
          version = "0.1.0";
          pyproject = true;
          src = ./.;
          build-system = [ pkgs.python3Packages.setuptools ];
          dependencies = with pkgs.python3Packages; [
            pydantic pydantic-settings pyyaml docker croniter inotify-simple sdnotify aiohttp
          ];
        };
        default = mdclaw;
      });
    };
}
