# The NixOS VM test (`nix flake check`, or `nix build .#checks.x86_64-linux.nixos`): the module
# with Podman (and dockerd beside it), the flake's free agent image, and a scripted
# OpenAI-compatible model server inside the VM. A message posted to the local HTTP channel
# (with its generated token) must come back answered; root's `mdclaw` runs as the service with
# its credentials, a member of the mdclaw group runs the read-only commands.
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

      # A member of the mdclaw group: reads status, lists and logs; cannot post as main.
      users.users.alice = {
        isNormalUser = true;
        extraGroups = [ "mdclaw" ];
      };
      # dockerd beside Podman: mdclaw does not claim /run/docker.sock, so both evaluate.
      virtualisation.docker.enable = true;

      environment.systemPackages = [ pkgs.curl ];
    };

  testScript = ''
    machine.wait_for_unit("fake-model.service")
    machine.wait_for_open_port(8080)
    machine.wait_for_unit("mdclaw.service")
    machine.wait_for_open_port(3000)

    with subtest("the image from the flake was loaded before start"):
        machine.succeed("podman images --format '{{.Repository}}' | grep -q mdclaw-agent")

    with subtest("the HTTP channel has a generated token only the service (and root) reads"):
        machine.succeed("test \"$(stat -c '%a %U' /var/lib/mdclaw/http-secret)\" = '600 mdclaw'")
        token = machine.succeed("mdclaw http-token").strip()
        assert len(token) >= 40, token
        machine.fail("su -l alice -c 'mdclaw http-token'")
        code = machine.succeed(
            "su -l alice -c \"curl -s -o /dev/null -w '%{http_code}' -X POST "
            + "-H 'Content-Type: application/json' "
            + "-d '{\\\"jid\\\": \\\"hl:main\\\", \\\"text\\\": \\\"as main\\\"}' "
            + "http://127.0.0.1:3000/message\""
        )
        assert code.strip() == "401", code

    with subtest("a message to the local HTTP channel gets the agent's reply"):
        machine.succeed("curl -sf http://127.0.0.1:3000/health")
        machine.succeed(
            f"curl -sf -X POST -H 'Authorization: Bearer {token}' "
            + "-H 'Content-Type: application/json' "
            + "-d '{\"jid\": \"hl:main\", \"text\": \"hello from the VM test\"}' "
            + "http://127.0.0.1:3000/message"
        )
        machine.wait_until_succeeds(
            f"curl -sf -H 'Authorization: Bearer {token}' "
            + "'http://127.0.0.1:3000/messages?jid=hl:main' "
            + "| grep -q 'Hello from the fake model'",
            timeout=300,
        )

    with subtest("root's mdclaw runs as the service, with its credentials"):
        machine.succeed("mdclaw check-config")
        machine.succeed("mdclaw status | grep -q 'daemon: running'")
        doctor = machine.execute("mdclaw doctor")[1]
        machine.log(doctor)
        assert "models.local.api_key_file" in doctor and "is readable" in doctor, doctor
        machine.succeed("mdclaw groups list | grep -q hl:main")
        machine.succeed("mdclaw tasks list")
        machine.succeed("mdclaw outbox list")
        machine.succeed("mdclaw usage")
        machine.succeed("mdclaw image status | grep -q present")
        machine.succeed("mdclaw send -g main --wait 120 'hello from the admin' | grep -q 'Hello from the fake model'")
        machine.fail("mdclaw run")

    with subtest("a member of the mdclaw group runs the read-only commands"):
        for cmd in ["status", "groups list", "tasks list", "outbox list", "usage", "failures"]:
            machine.succeed(f"su -l alice -c 'mdclaw {cmd}'")
        doctor = machine.execute("su -l alice -c 'mdclaw doctor'")[1]
        assert "set in the service's credentials" in doctor, doctor

    with subtest("a restart finds the image loaded and skips the upload"):
        machine.succeed("systemctl restart mdclaw-image.service")
        machine.succeed("journalctl -u mdclaw-image.service -b | grep -q 'not loaded again'")
        start = float(machine.succeed("date +%s.%N"))
        machine.succeed("systemctl restart mdclaw.service")  # returns once READY=1
        took = float(machine.succeed("date +%s.%N")) - start
        machine.log(f"restart to READY=1 with the image loaded: {took:.1f} s (TimeoutStartSec=90s)")
        assert took < 90, took
        machine.wait_for_open_port(3000)

    with subtest("the real key reached the model server through the proxy"):
        machine.succeed("grep -q 'Bearer real-secret-key' /var/lib/fake-model/requests.log")

    with subtest("reload (SIGHUP) keeps serving"):
        machine.succeed("systemctl reload mdclaw.service")
        machine.sleep(2)
        machine.succeed("systemctl is-active mdclaw.service")
        machine.succeed("curl -sf http://127.0.0.1:3000/health")

    with subtest("hardening score stays at or below 1.7"):
        for unit in ["mdclaw.service", "mdclaw-image.service"]:
            line = machine.succeed(f"systemd-analyze security {unit} | tail -n 1")
            machine.log(line)
            score = float(line.split(":")[1].split()[0])
            assert score <= 1.7, line
  '';
}
