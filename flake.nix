{
  description = "mdclaw: self-hosted personal AI assistant host, one sandboxed agent container per chat group";

  # nixpkgs follows the nixos-26.05 branch; the exact revision every build uses is the one the
  # committed flake.lock records (its revision and date: docs/nixos.md "Pinning nixpkgs").
  # `nix flake update nixpkgs` moves the lock to the branch's newest revision.
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-26.05";

  outputs =
    { self, nixpkgs }:
    let
      inherit (nixpkgs) lib;
      systems = [
        "x86_64-linux"
        "aarch64-linux"
      ];

      # Everything the flake builds is free, except container-image-claude: the claude backend
      # runs Anthropic's Claude Code CLI (unfree), allowed for that one output only.
      pkgsFor =
        system:
        import nixpkgs {
          inherit system;
          overlays = [ self.overlays.default ];
        };
      pkgsClaudeFor =
        system:
        import nixpkgs {
          inherit system;
          overlays = [ self.overlays.default ];
          config.allowUnfreePredicate = pkg: lib.getName pkg == "claude-code";
        };
      forAllSystems = f: lib.genAttrs systems (system: f (pkgsFor system));

      pyproject = lib.importTOML ./pyproject.toml;
      agentPyproject = lib.importTOML ./container/agent-runner/pyproject.toml;

      # "name[extra]>=1.0 ; marker  # comment" -> "name" (PEP 503 normalised), for each line
      # that names a package; pip options (-r, --hash, ...) and blank lines are skipped.
      requirementName =
        line:
        let
          m = builtins.match "[[:space:]]*([A-Za-z0-9][A-Za-z0-9._-]*).*" line;
        in
        if m == null then
          null
        else
          lib.toLower (
            builtins.replaceStrings
              [
                "_"
                "."
              ]
              [
                "-"
                "-"
              ]
              (builtins.head m)
          );
      parseRequirements =
        text:
        builtins.filter (n: n != null) (
          map (
            line:
            let
              code = builtins.head (lib.splitString "#" line);
            in
            if lib.hasPrefix "-" (lib.trim code) then null else requirementName code
          ) (lib.splitString "\n" text)
        );

      # The agent image's Python packages: container/requirements.txt, the one list the
      # Dockerfile's wheelhouse is built from too. Versions are nixpkgs' (the pins are pip's);
      # lines tagged "optional: claude" are included, with nixpkgs' claude-code CLI.
      imageRequirementsText = builtins.readFile ./container/requirements.txt;
      imageRequirements = parseRequirements imageRequirementsText;
      # Lines tagged "optional: claude": only in the Claude image.
      claudeRequirements = parseRequirements (
        lib.concatStringsSep "\n" (
          builtins.filter (l: builtins.match ".*#.*optional: claude.*" l != null) (
            lib.splitString "\n" imageRequirementsText
          )
        )
      );

      # PyPI name -> nixpkgs python package, where the attribute differs from the name.
      # The agent runner itself is built from container/agent-runner, not taken from here.
      pythonAttr = {
        pytest = "pytestCheckHook";
        discord-py = "discordpy";
      };
      skipInImage = [ "mdclaw-agent" ];
      pythonPackage =
        ps: name:
        let
          attr = pythonAttr.${name} or name;
        in
        ps.${attr} or (throw "mdclaw flake: no nixpkgs python package '${attr}' for requirement '${name}'; add it to pythonAttr in flake.nix");
      # Chat channels whose library nixpkgs has: their extras of pyproject.toml are part of the
      # package (imapclient; discord.py as nixpkgs' discordpy; matrix-nio; slack-bolt and
      # slack-sdk; the web chat's Web Push, pywebpush). WhatsApp's neonize is not in nixpkgs:
      # `pip install 'mdclaw[whatsapp]'`; nor is the `age` extra's pyrage (encrypted backups):
      # see docs/nixos.md.
      channelExtras = [
        "push"
        "email"
        "discord"
        "matrix"
        "slack"
      ];
      # Backends the image can do without: if nixpkgs lacks one, the image is built without
      # it (with a warning) rather than not at all; groups using it then fail with a clear error.
      optionalInImage = [ "claude-agent-sdk" ];
      imageNames =
        withClaude: ps:
        builtins.filter (
          name:
          if builtins.elem name optionalInImage && !(ps ? ${pythonAttr.${name} or name}) then
            lib.warn "mdclaw flake: nixpkgs has no python package '${name}'; the agent image is built without it" false
          else
            true
        ) (lib.subtractLists (skipInImage ++ lib.optionals (!withClaude) claudeRequirements) imageRequirements);
      imagePythonPackages = withClaude: ps: map (pythonPackage ps) (imageNames withClaude ps);

      # Programs a Python package needs next to it in the image (the SDK drives the CLI).
      imageExtraPrograms = pkgs: {
        claude-agent-sdk = [ pkgs.claude-code ];
      };
      # The agent image (see the overlay): the free one, or with the claude backend.
      mkAgentImage =
        final:
        { withClaude }:
        let
          python = final.python3.withPackages (
            ps: [ final.mdclaw-agent-runner ] ++ imagePythonPackages withClaude ps
          );
          inImage = imageNames withClaude final.python3Packages;
          # The backends in the image: the host checks its label before a run and in `doctor`.
          backends = [ "openai" ] ++ lib.optional (builtins.elem "claude-agent-sdk" inImage) "claude";
          extraPrograms = lib.concatLists (
            lib.mapAttrsToList (name: programs: lib.optionals (builtins.elem name inImage) programs) (
              imageExtraPrograms final
            )
          );
          etc = final.runCommand "mdclaw-agent-etc" { } ''
            mkdir -p $out/etc
            cat > $out/etc/passwd <<'EOF'
            root:x:0:0:root:/root:/bin/sh
            node:x:1000:1000:agent:/home/node:/bin/sh
            nobody:x:65534:65534:nobody:/var/empty:/bin/false
            EOF
            cat > $out/etc/group <<'EOF'
            root:x:0:
            node:x:1000:
            nobody:x:65534:
            EOF
            echo 'hosts: files dns' > $out/etc/nsswitch.conf
          '';
        in
        (final.dockerTools.buildLayeredImage {
          name = "mdclaw-agent";
          # No tag: the tag is derived from the image's content, so every change is a new
          # reference and the NixOS module switches agents to it (settings.runtime.image).
          created = "1970-01-01T00:00:01Z";
          contents = [
            python
            etc
            final.cacert
            final.tzdata
            final.bashInteractive
            final.coreutils
          ]
          ++ extraPrograms;
          extraCommands = ''
            mkdir -p tmp workspace/group workspace/ipc workspace/global workspace/extra
            chmod 1777 tmp
          '';
          fakeRootCommands = ''
            mkdir -p home/node/.claude
            chown -R 1000:1000 home/node
          '';
          config = {
            User = "1000:1000";
            WorkingDirectory = "/workspace/group";
            # As container/Dockerfile: a command given at run time becomes the runner's arguments.
            Entrypoint = [
              "/bin/python3"
              "-m"
              "mdclaw_agent"
            ];
            Env = [
              "PATH=/bin"
              "HOME=/home/node"
              "LANG=C.UTF-8"
              "PYTHONUNBUFFERED=1"
              "PYTHONDONTWRITEBYTECODE=1"
              "SSL_CERT_FILE=/etc/ssl/certs/ca-bundle.crt"
              "TZDIR=/share/zoneinfo"
              "PYTHONTZPATH=/share/zoneinfo"
            ];
            Labels = {
              "org.opencontainers.image.title" = "mdclaw-agent";
              "org.opencontainers.image.description" = "mdclaw's in-container agent runner";
              "mdclaw.backends" = lib.concatStringsSep "," backends;
            };
          };
        })
        // {
          # Read by the NixOS module's assertions (nothing here forces the image's build).
          mdclawBackends = backends;
          mdclawClaudeCodeAllowed =
            !withClaude
            || (final.config.allowUnfree or false)
            || (final.config.allowUnfreePredicate or (_: false)) final.claude-code;
        };
    in
    {
      lib = {
        inherit parseRequirements imageRequirements claudeRequirements;
        hostRequirements = map requirementName pyproject.project.dependencies;
        channelRequirements = lib.concatMap (
          extra: map requirementName (pyproject.project.optional-dependencies.${extra} or [ ])
        ) channelExtras;
      };

      overlays.default = final: prev: {
        mdclaw = final.python3Packages.callPackage (
          {
            buildPythonApplication,
            setuptools,
          }:
          buildPythonApplication {
            pname = "mdclaw";
            inherit (pyproject.project) version;
            pyproject = true;
            src = lib.cleanSource ./.;

            build-system = [ setuptools ];
            dependencies =
              map (pythonPackage final.python3Packages) (
                self.lib.hostRequirements ++ self.lib.channelRequirements
              )
              # zoneinfo's data where the system has none (build sandbox, minimal images).
              ++ [ final.python3Packages.tzdata ];
            nativeCheckInputs = map (pythonPackage final.python3Packages) (
              map requirementName (pyproject.project.optional-dependencies.test or [ ])
            );

            # The engine tests (marked e2e) need a container engine: the VM test covers them.
            disabledTestMarks = [ "e2e" ];
            disabledTestPaths = [
              # These compare committed files with what the developers' pydantic generates;
              # nixpkgs' pydantic may format the schema differently. CI runs them.
              "tests/test_config_schema.py"
              "tests/test_command_schema_fresh.py"
              "tests/test_wire_schema_fresh.py"
              # Nix inside the Nix build sandbox: not available there. CI runs them.
              "tests/test_nix_parse.py"
              "tests/test_nix_module.py"
              "tests/test_nix_module_strict.py"
              "tests/test_nix_flake.py"
              # The import contract is checked with import-linter, a lint tool (the `lint`
              # extra, not packaged for the build's check). CI runs it (make lint, and this).
              "tests/test_import_contract.py"
            ];
            preCheck = ''
              export HOME="$TMPDIR"
            '';
            pythonImportsCheck = [ "mdclaw" ];

            meta = {
              description = pyproject.project.description;
              license = lib.licenses.mit;
              mainProgram = "mdclaw";
              platforms = lib.platforms.linux;
            };
          }
        ) { };

        mdclaw-agent-runner = final.python3Packages.buildPythonPackage {
          pname = "mdclaw-agent";
          inherit (agentPyproject.project) version;
          pyproject = true;
          src = lib.cleanSource ./container/agent-runner;
          build-system = [ final.python3Packages.setuptools ];
          # The free image's packages; the Claude image adds its own (mkAgentImage).
          dependencies = imagePythonPackages false final.python3Packages;
          # Its tests live in the host's test suite (they drive it against the host).
          doCheck = false;
          pythonImportsCheck = [ "mdclaw_agent" ];
        };

        # The agent images: reproducible (no timestamps, content-derived tag), non-root.
        # mdclaw-agent-image is free (openai backend: local and OpenAI-compatible models);
        # mdclaw-agent-image-claude adds the claude backend and claude-code (unfree: the
        # nixpkgs it is built from must allow it, see docs/nixos.md).
        mdclaw-agent-image = mkAgentImage final { withClaude = false; };
        mdclaw-agent-image-claude = mkAgentImage final { withClaude = true; };
      };

      packages = lib.genAttrs systems (
        system:
        let
          pkgs = pkgsFor system;
        in
        {
          default = pkgs.mdclaw;
          mdclaw = pkgs.mdclaw;
          container-image = pkgs.mdclaw-agent-image;
          # Holds claude-code: by building it you accept its licence (unfree).
          container-image-claude = (pkgsClaudeFor system).mdclaw-agent-image-claude;
        }
      );
      apps = forAllSystems (pkgs: {
        default = {
          type = "app";
          program = lib.getExe pkgs.mdclaw;
          meta.description = "mdclaw's command line (mdclaw run, check-config, status, ...)";
        };
      });

      devShells = forAllSystems (pkgs: {
        default = pkgs.mkShell {
          inputsFrom = [ pkgs.mdclaw ];
          packages = [
            (pkgs.python3.withPackages (
              ps:
              map (pythonPackage ps) (
                self.lib.hostRequirements
                ++ map requirementName (pyproject.project.optional-dependencies.test or [ ])
              )
            ))
            pkgs.nixfmt
            pkgs.podman
            pkgs.gnumake
          ];
          shellHook = ''
            export PYTHONPATH="$PWD''${PYTHONPATH:+:$PYTHONPATH}"
          '';
        };
      });

      # RFC 166 style (nixpkgs called it nixfmt-rfc-style before 25.11).
      formatter = forAllSystems (pkgs: pkgs.nixfmt);

      # The module with this flake's package and image as defaults (no overlay needed).
      # The free image, or the Claude one when a model uses the claude backend (the flake
      # allows claude-code for that output only; your nixpkgs' config is not involved).
      nixosModules.default =
        {
          config,
          pkgs,
          lib,
          ...
        }:
        let
          own = self.packages.${pkgs.stdenv.hostPlatform.system};
          usesClaude = lib.any (m: m.backend == "claude") (
            lib.attrValues config.services.mdclaw.settings.models
          );
        in
        {
          imports = [ ./nixos-module ];
          services.mdclaw.package = lib.mkDefault own.mdclaw;
          services.mdclaw.image = lib.mkDefault (
            if usesClaude then own.container-image-claude else own.container-image
          );
        };

      checks = forAllSystems (pkgs: {
        # The package with its test suite (checkPhase).
        mdclaw = pkgs.mdclaw;
        # The free image only: `nix flake check` needs no unfree licence.
        container-image = pkgs.mdclaw-agent-image;
        # A VM with the module, Podman's Docker socket, the image, a fake model server:
        # a message posted to the local HTTP channel gets the agent's reply.
        nixos = import ./nixos-module/vm-test.nix {
          inherit pkgs;
          module = self.nixosModules.default;
        };
      });
    };
}
