"""flake.nix's outputs, evaluated against a stub nixpkgs with nixpkgs' real lib.

Runs whenever NIXPKGS_LIB is set (tests/nix/eval-flake.nix, tests/nix/fake-nixpkgs/). Nothing
is built: the stub builders record their arguments, and these tests check them.
"""

from __future__ import annotations

import ast
import base64
import json
import re
import shutil
import subprocess
import sys
import time
import tomllib
from datetime import UTC, datetime
from pathlib import Path

import pytest

from nixeval import NIX_DIR, REPO, eval_json, nix_instantiate, nixpkgs_lib
from waiting import wait_until

SYSTEMS = ["aarch64-linux", "x86_64-linux"]


@pytest.fixture(scope="module")
def flake() -> dict:
    lib = nixpkgs_lib()
    r = eval_json(NIX_DIR / "eval-flake.nix", {"nixpkgsLib": str(lib)}, lib)
    assert r.returncode == 0, f"flake.nix does not evaluate:\n{r.stderr}"
    return json.loads(r.stdout)


def test_outputs_for_both_systems(flake: dict) -> None:
    assert flake["nixpkgsUrl"].startswith("github:NixOS/nixpkgs/nixos-")
    for kind in ("packages", "apps", "devShells", "formatter", "checks"):
        assert flake["systems"][kind] == SYSTEMS, kind
    assert set(flake["packages"]) == {"default", "mdclaw", "container-image",
                                      "container-image-claude"}
    assert flake["defaultIsMdclaw"]
    assert set(flake["checks"]) == {"mdclaw", "container-image", "nixos"}
    assert {"overlays", "nixosModules", "lib"} <= set(flake["outputs"])
    assert flake["app"]["type"] == "app" and flake["app"]["program"].endswith("/bin/mdclaw")
    assert flake["formatter"].startswith("nixfmt")
    assert set(flake["overlayAttrs"]) == {"mdclaw", "mdclaw-agent-runner", "mdclaw-agent-image",
                                          "mdclaw-agent-image-claude"}


def test_package_is_the_pyproject(flake: dict) -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pkg = flake["mdclaw"]
    assert pkg["pname"] == "mdclaw" and pkg["version"] == pyproject["project"]["version"]
    assert pkg["pyproject"] is True and pkg["mainProgram"] == "mdclaw"
    assert pkg["buildSystem"] == ["python3.12-setuptools"]
    # every runtime dependency of pyproject.toml, from nixpkgs (plus zoneinfo's data)
    assert flake["lib"]["hostRequirements"] == [
        _name(d) for d in pyproject["project"]["dependencies"]]
    # and the libraries of the chat channels nixpkgs has (their extras)
    assert flake["lib"]["channelRequirements"] == [
        _name(d) for extra in ("push", "email", "discord", "matrix", "slack")
        for d in pyproject["project"]["optional-dependencies"][extra]]
    # a NixOS user gets the Slack channel: Bolt and the SDK are in the package itself
    assert {"python3.12-slack-bolt", "python3.12-slack-sdk"} <= set(pkg["dependencies"])
    nix_attr = {"discord-py": "discordpy"}  # nixpkgs' name where it differs
    assert pkg["dependencies"] == [f"python3.12-{nix_attr.get(n, n)}"
                                   for n in flake["lib"]["hostRequirements"]
                                   + flake["lib"]["channelRequirements"]] \
        + ["python3.12-tzdata"]
    assert "python3.12-pytestCheckHook" in pkg["checkInputs"]
    # tests run in checkPhase, except the ones that need an engine (the VM test has one)
    assert pkg["disabledTestMarks"] == ["e2e"]
    for path in pkg["disabledTestPaths"]:
        assert (REPO / path).is_file(), f"disabledTestPaths names a missing file: {path}"


def _name(requirement: str) -> str:
    import re

    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert m
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


def test_image_is_reproducible_non_root_with_certificates(flake: dict) -> None:
    img = flake["image"]
    assert img["imageName"] == "mdclaw-agent" and img["name"] == "mdclaw-agent.tar.gz"
    assert img["created"] == "1970-01-01T00:00:01Z"  # fixed: bit-for-bit reproducible
    assert img["tag"] is None  # the tag comes from the content
    cfg = img["config"]
    assert cfg["User"] == "1000:1000"
    # the same entry point and working directory as container/Dockerfile
    assert cfg["Entrypoint"] == ["/bin/python3", "-m", "mdclaw_agent"]
    dockerfile = (REPO / "container" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["python3", "-m", "mdclaw_agent"]' in dockerfile
    assert f"WORKDIR {cfg['WorkingDirectory']}" in dockerfile
    assert f"USER {cfg['User']}" in dockerfile
    assert "HOME=/home/node" in cfg["Env"]
    assert "SSL_CERT_FILE=/etc/ssl/certs/ca-bundle.crt" in cfg["Env"]
    assert any(c.startswith("nss-cacert") for c in img["contents"])
    assert "chmod 1777 tmp" in img["extraCommands"]
    assert "chown -R 1000:1000 home/node" in img["fakeRootCommands"]


def test_image_holds_the_shared_requirement_list(flake: dict) -> None:
    """The image's Python packages are the list the Dockerfile installs too."""
    reqs = flake["lib"]["imageRequirements"]
    shared = REPO / "container" / "requirements.txt"
    expected = [_name(line.split("#")[0]) for line in shared.read_text().splitlines()
                if line.split("#")[0].strip() and not line.strip().startswith("-")]
    assert reqs == expected and reqs
    claude_only = flake["lib"]["claudeRequirements"]
    assert claude_only == ["claude-agent-sdk"]  # the lines tagged "optional: claude"
    python = flake["claudeImage"]["python"]
    assert python[0].startswith("python3.12-mdclaw-agent-")
    assert python[1:] == [f"python3.12-{n}" for n in reqs if n != "mdclaw-agent"]
    # the SDK drives the Claude Code CLI
    assert any(c.startswith("claude-code") for c in flake["claudeImage"]["contents"])
    free = flake["image"]["python"]
    assert free[1:] == [f"python3.12-{n}" for n in reqs
                        if n != "mdclaw-agent" and n not in claude_only]


def test_default_image_is_free_and_the_claude_image_its_own_output(flake: dict) -> None:
    """`nix build .#container-image` needs no unfree licence: nothing in it is unfree (the
    stub nixpkgs refuses claude-code's store path unless its config allows it, as nixpkgs
    does). The Claude image is built from a nixpkgs that allows claude-code only."""
    free, claude = flake["image"], flake["claudeImage"]
    assert free["builds"] is True and claude["builds"] is True
    assert not any("claude" in p for p in free["contents"] + free["python"])
    assert free["backends"] == ["openai"] and free["config"]["Labels"]["mdclaw.backends"] == \
        "openai"
    assert claude["backends"] == ["openai", "claude"]
    assert claude["config"]["Labels"]["mdclaw.backends"] == "openai,claude"
    assert claude["claudeCodeAllowed"] is True
    # the overlay in a nixpkgs that allows nothing unfree: the free image builds; the Claude
    # image cannot, and says so (the module's assertion names allowUnfreePredicate)
    assert flake["overlayFreeBuilds"] is True
    assert flake["overlayClaudeBuilds"] is False
    assert flake["overlayClaudeAllowed"] is False
    # the flake check builds the free image only
    assert "container-image-claude" not in flake["checks"]


def test_flake_module_picks_the_image_by_backend(flake: dict) -> None:
    mod = flake["nixosModule"]
    assert mod["imageBackends"] == ["openai"]
    assert mod["claudeImageBackends"] == ["openai", "claude"]


def test_requirement_parsing(flake: dict) -> None:
    assert flake["lib"]["parsed"] == ["inotify-simple", "claude-agent-sdk", "zope-interface"]


def test_nixos_module_output_brings_package_and_image(flake: dict) -> None:
    mod = flake["nixosModule"]
    assert mod["imports"] == [str(REPO / "nixos-module")]
    assert mod["package"].startswith("mdclaw-") and mod["packagePriority"] == 1000  # mkDefault
    assert mod["image"] == "mdclaw-agent.tar.gz"


def test_vm_test_script_is_valid_python(flake: dict) -> None:
    vm = flake["vmTest"]
    assert vm["name"] == "mdclaw"
    tree = ast.parse(vm["testScript"])
    calls = {n.func.attr for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert {"wait_for_unit", "succeed", "wait_until_succeeds"} <= calls
    assert "/message" in vm["testScript"] and "/messages?jid=hl:main" in vm["testScript"]


def test_vm_fake_model_server_answers(tmp_path: Path) -> None:
    """The scripted model server the VM test runs, here on loopback."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "requests.log"
    proc = subprocess.Popen([sys.executable, str(REPO / "nixos-module/vm-test-fake-model.py"),
                             str(port), str(log)], stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in proc.stdout.readline()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps({"model": "fake-model", "messages": []}).encode(),
            headers={"Authorization": "Bearer real-secret-key",
                     "Content-Type": "application/json"})
        def answer() -> dict:
            with urllib.request.urlopen(req, timeout=5) as r:
                return json.loads(r.read())

        body = wait_until(answer, 10, interval=0.1, ignore=(OSError,),
                          what="the proxy to answer")
        assert body["choices"][0]["message"]["content"] == "Hello from the fake model"
        assert "Bearer real-secret-key" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_image_without_an_optional_backend_still_evaluates() -> None:
    """A nixpkgs without claude-agent-sdk gives an image without it, and says so."""
    lib = nixpkgs_lib()
    r = eval_json(NIX_DIR / "eval-flake.nix", {"nixpkgsLib": str(lib)}, lib,
                  env={"FAKE_NIXPKGS_WITHOUT": "claude-agent-sdk"})
    assert r.returncode == 0, r.stderr
    image = json.loads(r.stdout)["claudeImage"]
    assert not any("claude" in p for p in image["python"])
    assert image["backends"] == ["openai"]
    if "claude-agent-sdk" in json.loads(r.stdout)["lib"]["imageRequirements"]:
        assert "built without it" in r.stderr


def test_a_requirement_nixpkgs_lacks_fails_evaluation() -> None:
    lib = nixpkgs_lib()
    r = eval_json(NIX_DIR / "eval-flake.nix", {"nixpkgsLib": str(lib)}, lib,
                  env={"FAKE_NIXPKGS_WITHOUT": "croniter"})
    assert r.returncode != 0
    assert "no nixpkgs python package 'croniter'" in r.stderr


REV = re.compile(r"^[0-9a-f]{40}$")
SRI_SHA256 = re.compile(r"^sha256-[A-Za-z0-9+/]{43}=$")
LOCK = REPO / "flake.lock"
# nixos-26.05 was branched off in May 2026: a head of that branch is never older.
BRANCH_START = 1777593600  # 2026-05-01T00:00:00Z


def github_input(url: str) -> dict[str, str]:
    """`github:OWNER/REPO/REF` (or `?ref=REF`) as a flake.lock `original` entry."""
    m = re.fullmatch(r"github:([^/?]+)/([^/?]+)(?:/([^/?]+)|\?ref=([^&]+))?", url)
    assert m, f"not a github: flake URL: {url}"
    owner, repo, ref, qref = m.groups()
    original = {"type": "github", "owner": owner, "repo": repo}
    if ref or qref:
        original["ref"] = ref or qref
    return original


def lock_problems(lock: dict, url: str) -> list[str]:
    """What is wrong with flake.lock for a flake whose only input is nixpkgs at `url`: the
    shape nix writes (lock version 7), the entry following exactly that input, and a locked
    revision and content hash of the form `nix flake lock` records."""
    problems = []
    if lock.get("version") != 7:
        problems.append(f"lock version {lock.get('version')!r}, nix writes 7")
    if lock.get("root") != "root":
        problems.append("the root node is not 'root'")
    nodes = lock.get("nodes", {})
    if set(nodes) != {"root", "nixpkgs"}:
        problems.append(f"nodes {sorted(nodes)}: the flake has one input, nixpkgs")
    if nodes.get("root") != {"inputs": {"nixpkgs": "nixpkgs"}}:
        problems.append("the root node's inputs are not {nixpkgs: nixpkgs}")
    node = nodes.get("nixpkgs", {})
    if set(node) != {"locked", "original"}:
        problems.append(f"the nixpkgs node has {sorted(node)}, not locked and original")
    original, locked = node.get("original", {}), node.get("locked", {})
    if original != github_input(url):
        problems.append(f"original {original} does not follow flake.nix's input {url}")
    if set(locked) != {"lastModified", "narHash", "owner", "repo", "rev", "type"}:
        problems.append(f"locked has {sorted(locked)}")
    for key in ("type", "owner", "repo"):
        if locked.get(key) != original.get(key):
            problems.append(f"locked {key} {locked.get(key)!r} is not {original.get(key)!r}")
    if not REV.match(str(locked.get("rev", ""))):
        problems.append(f"rev {locked.get('rev')!r} is not a full commit hash")
    nar = str(locked.get("narHash", ""))
    if not SRI_SHA256.match(nar) or len(base64.b64decode(nar.removeprefix("sha256-"))) != 32:
        problems.append(f"narHash {nar!r} is not a sha256 SRI hash")
    modified = locked.get("lastModified")
    if not isinstance(modified, int) or not BRANCH_START <= modified <= time.time():
        problems.append(f"lastModified {modified!r} is not a time on the nixos-26.05 branch")
    return problems


def nixpkgs_pin(url: str) -> str | None:
    """The exact nixpkgs revision the flake builds with: from the input URL, else from a
    committed flake.lock that locks that input; None when neither."""
    tail = url.rsplit("/", 1)[-1]
    if REV.match(tail):
        return tail
    if not LOCK.is_file():
        return None
    lock = json.loads(LOCK.read_text())
    assert lock_problems(lock, url) == []
    rev: str = lock["nodes"]["nixpkgs"]["locked"]["rev"]
    return rev


def test_nixpkgs_branch(flake: dict) -> None:
    assert flake["nixpkgsUrl"] in ("github:NixOS/nixpkgs/nixos-26.05",) or \
        REV.match(flake["nixpkgsUrl"].rsplit("/", 1)[-1])


def test_nixpkgs_is_pinned(flake: dict) -> None:
    # the input follows the branch (so `nix flake update nixpkgs` moves it) and the committed
    # lock holds the revision every build uses
    assert nixpkgs_pin(flake["nixpkgsUrl"]) is not None


def test_flake_lock_locks_the_nixpkgs_input(flake: dict) -> None:
    lock = json.loads(LOCK.read_text())
    assert lock_problems(lock, flake["nixpkgsUrl"]) == []
    # written as nix writes it (sorted keys, two-space indent), so an update is a small diff
    assert LOCK.read_text() == json.dumps(lock, indent=2, sort_keys=True) + "\n"


def _lock() -> dict:
    return json.loads(LOCK.read_text())


@pytest.mark.parametrize("plant, found", [
    (lambda lk: lk.update(version=6), "lock version"),
    (lambda lk: lk["nodes"]["nixpkgs"]["original"].update(ref="nixos-25.11"), "does not follow"),
    (lambda lk: lk["nodes"]["nixpkgs"]["original"].pop("ref"), "does not follow"),
    (lambda lk: lk["nodes"]["nixpkgs"]["locked"].update(owner="someone"), "locked owner"),
    (lambda lk: lk["nodes"]["nixpkgs"]["locked"].update(rev="abc123"), "full commit hash"),
    (lambda lk: lk["nodes"]["nixpkgs"]["locked"].update(narHash="sha256-x"), "SRI"),
    (lambda lk: lk["nodes"]["nixpkgs"]["locked"].pop("narHash"), "SRI"),
    (lambda lk: lk["nodes"]["nixpkgs"]["locked"].update(lastModified=1700000000), "branch"),
    (lambda lk: lk["nodes"]["root"]["inputs"].update(nixpkgs="nixpkgs_2"), "root node"),
    (lambda lk: lk["nodes"].update(extra={}), "one input"),
])
def test_lock_checks_catch_a_planted_fault(flake: dict, plant, found: str) -> None:
    lock = _lock()
    plant(lock)
    problems = lock_problems(lock, flake["nixpkgsUrl"])
    assert any(found in p for p in problems), problems


def test_nix_reads_the_lock_as_up_to_date(tmp_path: Path) -> None:
    """nix itself (2.8 here) takes flake.lock as the lock of flake.nix's inputs: offline, with
    updates forbidden, `nix flake metadata` reports the committed lock unchanged. A lock that
    did not match the input would make nix resolve the branch again (a download)."""
    nix = Path(nix_instantiate()).with_name("nix")
    if not nix.is_file():
        pytest.fail(f"{nix} is missing beside nix-instantiate")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("flake.nix", "flake.lock"):
        shutil.copy(REPO / name, src / name)
    r = subprocess.run(
        [str(nix), "--extra-experimental-features", "nix-command flakes",
         "--store", str(tmp_path / "store"), "--offline",
         "flake", "metadata", "--json", "--no-update-lock-file", f"path:{src}"],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["locks"] == _lock()
    assert (src / "flake.lock").read_text() == LOCK.read_text()


def test_docs_name_the_locked_revision() -> None:
    locked = _lock()["nodes"]["nixpkgs"]["locked"]
    day = datetime.fromtimestamp(locked["lastModified"], tz=UTC).date().isoformat()
    docs = (REPO / "docs" / "nixos.md").read_text()
    section = docs[docs.index("## Pinning nixpkgs"):]
    section = section[:section.index("\n## ", 1)]
    assert f"`{locked['rev'][:12]}`" in section and day in section, \
        "docs/nixos.md 'Pinning nixpkgs' names another revision than flake.lock"
