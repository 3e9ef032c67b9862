# The NixOS VM test (`nix flake check`, or `nix build .#checks.x86_64-linux.nixos`): the module
# with Podman's Docker socket, the flake's agent image, and a scripted OpenAI-compatible model
# server inside the VM. A message posted to the local HTTP channel must come back answered.
{ pkgs, module }:
pkgs.testers.runNixOSTest {
  name = "mdclaw";

  nodes.machine =
    { pkgs, ... }:
    {
      imports = [ module ];

      virtualisation = {
        memorySize = 3072;
        diskSize = 8192;
        cores = 2;
      };

      services.mdclaw = {
        enable = true;
        containerEngine = "podman";
        credentials.model-key = "/run/secrets/model-key";
        settings = {
          assistant = {
            name = "Andy";
            timezone = "Europe/Berlin";
            model = "local";
          };
          models.local = {
            backend = "openai";
            model = "fake-model";
            base_url = "http://127.0.0.1:8080/v1";
            api_key_file = "$CREDENTIALS_DIRECTORY/model-key";
          };
          groups.main = {
            name = "Admin";
            jid = "hl:main";
            main = true;
          };
          channels.http.listen = "127.0.0.1:3000";
        };
      };

      # The secret is made at boot, readable by root only; it never enters the store.
      systemd.services.mdclaw-test-secret = {
        wantedBy = [ "mdclaw.service" ];
        before = [ "mdclaw.service" ];
        serviceConfig = {
          Type = "oneshot";
          RemainAfterExit = true;
        };
        script = ''
          install -d -m 0700 /run/secrets
          (umask 077; echo real-secret-key > /run/secrets/model-key)
        '';
      };

      systemd.services.fake-model = {
        wantedBy = [ "multi-user.target" ];
        before = [ "mdclaw.service" ];
        serviceConfig = {
          StateDirectory = "fake-model";
          ExecStart = "${pkgs.python3}/bin/python3 ${./vm-test-fake-model.py} 8080 /var/lib/fake-model/requests.log";
        };
      };

      environment.systemPackages = [ pkgs.curl ];
    };

  testScript = ''
    machine.wait_for_unit("fake-model.service")
    machine.wait_for_open_port(8080)
    machine.wait_for_unit("mdclaw.service")
    machine.wait_for_open_port(3000)

    with subtest("the image from the flake was loaded before start"):
        machine.succeed("podman images --format '{{.Repository}}' | grep -q mdclaw-agent")

    with subtest("a message to the local HTTP channel gets the agent's reply"):
        machine.succeed("curl -sf http://127.0.0.1:3000/health")
        machine.succeed(
            "curl -sf -X POST -H 'Content-Type: application/json' "
            + "-d '{\"jid\": \"hl:main\", \"text\": \"hello from the VM test\"}' "
            + "http://127.0.0.1:3000/message"
        )
        machine.wait_until_succeeds(
            "curl -sf 'http://127.0.0.1:3000/messages?jid=hl:main' "
            + "| grep -q 'Hello from the fake model'",
            timeout=300,
        )

    with subtest("the real key reached the model server through the proxy"):
        machine.succeed("grep -q 'Bearer real-secret-key' /var/lib/fake-model/requests.log")

    with subtest("reload (SIGHUP) keeps serving"):
        machine.succeed("systemctl reload mdclaw.service")
        machine.sleep(2)
        machine.succeed("systemctl is-active mdclaw.service")
        machine.succeed("curl -sf http://127.0.0.1:3000/health")

    machine.log(machine.succeed("systemd-analyze security mdclaw.service | tail -n 1"))
  '';
}
