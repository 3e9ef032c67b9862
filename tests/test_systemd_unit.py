"""contrib/systemd/mdclaw.service passes `systemd-analyze verify` without a single warning."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "contrib" / "systemd" / "mdclaw.service"


def analyzer() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is missing; .ci/setup-tools installs systemd")
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    return tool


def verify(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    """Verify `text` as a unit whose /usr/bin/mdclaw is a stand-in executable."""
    exe = tmp_path / "mdclaw"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    unit = tmp_path / "mdclaw.service"
    unit.write_text(text.replace("/usr/bin/mdclaw", str(exe)))
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""}
    return subprocess.run([analyzer(), "verify", str(unit)], capture_output=True, text=True,
                          env=env, timeout=60, cwd=tmp_path)


def unit_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """Diagnostics about our unit (systemd may also mention unrelated host units)."""
    return [ln for ln in (proc.stdout + proc.stderr).splitlines() if "mdclaw.service" in ln]


def test_unit_verifies_cleanly(tmp_path: Path) -> None:
    proc = verify(tmp_path, UNIT.read_text())
    assert proc.returncode == 0, proc.stderr
    assert unit_lines(proc) == []


def test_verify_catches_mistakes(tmp_path: Path) -> None:
    # the check above means something: a typo in a value is reported
    bad = UNIT.read_text().replace("Type=notify", "Type=notfy")
    assert any("notfy" in ln for ln in unit_lines(verify(tmp_path, bad)))


def test_unit_has_the_promised_settings() -> None:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # keys are case-sensitive
    cp.read_string(UNIT.read_text())
    s = cp["Service"]
    assert s["Type"] == "notify"
    assert s["WatchdogSec"] and s["Restart"] == "on-failure"
    assert s["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert s["ProtectSystem"] == "strict" and s["ReadWritePaths"] == "/var/lib/mdclaw"
    for key in ("ProtectHome", "NoNewPrivileges", "PrivateDevices"):
        assert s[key] == "yes", key
    assert "AF_UNIX" in s["RestrictAddressFamilies"]
    assert "@system-service" in UNIT.read_text()
    assert cp["Install"]["WantedBy"] == "multi-user.target"


def test_exposure_stays_low(tmp_path: Path) -> None:
    # systemd's own hardening score (0 best, 10 worst); the unit scores about 1.4 today.
    exe = tmp_path / "mdclaw"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    unit = tmp_path / "mdclaw.service"
    unit.write_text(UNIT.read_text().replace("/usr/bin/mdclaw", str(exe)))
    proc = subprocess.run([analyzer(), "security", "--offline=true", "--threshold=20",
                           "--no-pager", str(unit)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
