"""The cause table: every cause has a policy, a plain chat message and what the operator
can do; the agent runner's causes are all in it; messages hold no secrets or ids."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mdclaw import failures
from mdclaw.failures import (
    CAUSES,
    CONFIG,
    DETERMINISTIC,
    TRANSIENT,
    TurnFailure,
    chat_message,
    redact,
    retry_delay,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "container" / "agent-runner"))

from mdclaw_agent.protocol import CAUSES as RUNNER_CAUSES  # noqa: E402

HOST_CAUSES = {"oom_killed", "container_killed", "image_missing", "engine_down",
               "proxy_failure", "container_start", "no_model"}
CTX = {"base_url": "http://user:pw@10.0.0.5:11434/v1", "memory": "2g",
       "image": "mdclaw-agent:latest", "backend": "claude", "model_key": "local",
       "limit": "30 min"}


def test_every_cause_the_runner_reports_is_in_the_table() -> None:
    assert set(RUNNER_CAUSES) <= set(CAUSES)
    assert HOST_CAUSES <= set(CAUSES)


def test_each_cause_has_a_policy_text_and_operator_advice() -> None:
    for c in CAUSES.values():
        assert c.policy in (TRANSIENT, DETERMINISTIC, CONFIG), c
        assert c.what and c.operator, c
        if c.policy == CONFIG:
            assert c.fix, c


@pytest.mark.parametrize("policy, causes", [
    (TRANSIENT, {"model_unreachable", "model_disconnected", "model_server_error",
                 "rate_limited", "engine_down", "container_killed"}),
    (DETERMINISTIC, {"context_too_long", "model_refused", "model_malformed", "oom_killed"}),
    (CONFIG, {"no_model", "backend_missing", "key_missing", "image_missing"}),
])
def test_policies(policy, causes) -> None:
    assert {c for c in causes if CAUSES[c].policy == policy} == causes


@pytest.mark.parametrize("cause", sorted(CAUSES))
@pytest.mark.parametrize("outcome", ["retry", "gave_up", "dropped", "config", "resend"])
def test_messages_are_plain_and_complete(cause, outcome) -> None:
    f = TurnFailure(cause, detail="Traceback (most recent call last): sk-proj-abcdef123456",
                    http_status=400, api_message="bad thing", limit="8192 tokens")
    text = chat_message(f, CTX, outcome=outcome, delay=30, attempts=3)
    assert "{" not in text and "}" not in text, text
    assert "Traceback" not in text and "sk-proj" not in text and "pw@" not in text
    assert "status 1" not in text
    assert text.endswith("."), text


def test_the_issue_s_examples() -> None:
    down = TurnFailure("model_unreachable")
    assert chat_message(down, CTX, outcome="retry", delay=30) == (
        "The model server at 10.0.0.5:11434 is not answering. I'll try again in 30 s.")
    long = TurnFailure("context_too_long", limit="8192 tokens")
    assert chat_message(long, CTX, outcome="dropped").startswith(
        "That message is too long for the model (limit 8192 tokens).")
    assert "without the oldest history" in failures.trimmed_notice("8192 tokens")
    oom = TurnFailure("oom_killed")
    assert chat_message(oom, CTX, outcome="dropped").startswith(
        "I ran out of memory (limit 2g) while working on that.")
    refused = TurnFailure("model_refused", http_status=400, api_message="unsupported")
    assert "(HTTP 400: unsupported)" in chat_message(refused, CTX, outcome="dropped")
    cfg = chat_message(TurnFailure("no_model"), CTX, outcome="config")
    assert "`models:`" in cfg and "docs/configuration.md" in cfg
    cfg = chat_message(TurnFailure("backend_missing"), CTX, outcome="config")
    assert "claude backend" in cfg and "build-wheelhouse.sh --claude" in cfg


def test_counts_are_true() -> None:
    f = TurnFailure("model_unreachable")
    assert "tried once" in chat_message(f, CTX, outcome="gave_up", attempts=1)
    assert "tried twice" in chat_message(f, CTX, outcome="gave_up", attempts=2)
    assert "tried 5 times" in chat_message(f, CTX, outcome="gave_up", attempts=5)


def test_unknown_cause_is_an_agent_crash() -> None:
    f = TurnFailure("cosmic_rays", detail="x")
    assert f.cause == "agent_crash" and "cosmic_rays" in f.detail
    assert TurnFailure.from_block({"status": "error", "error": "boom"}).cause == "agent_crash"


def test_from_block_reads_the_runner_fields() -> None:
    f = TurnFailure.from_block({"status": "error", "error": "model API answered HTTP 429",
                                "cause": "rate_limited", "httpStatus": 429, "retryAfter": 7,
                                "apiMessage": "slow down"})
    assert (f.cause, f.http_status, f.retry_after, f.api_message) == (
        "rate_limited", 429, 7.0, "slow down")


def test_host_side_causes_from_a_result() -> None:
    def res(**kw):
        base = dict(exit_code=1, timed_out=False, oom_killed=False, error=None,
                    stderr_tail="a\nb\nTraceback: boom")
        return SimpleNamespace(**{**base, **kw})

    assert failures.from_result(res(timed_out=True)).cause == "turn_timeout"
    assert failures.from_result(res(exit_code=137, oom_killed=True)).cause == "oom_killed"
    assert failures.from_result(res(exit_code=137)).cause == "container_killed"
    assert failures.from_result(res(exit_code=-1)).cause == "container_killed"
    assert failures.from_result(res(exit_code=2)).cause == "invalid_input"
    crash = failures.from_result(res(exit_code=1))
    assert crash.cause == "agent_crash" and "boom" in crash.detail


def test_host_side_causes_from_exceptions() -> None:
    from mdclaw.proxy import ProxyError
    from mdclaw.runtime import EngineCallError, EngineUnavailable, ImageError

    assert failures.from_exception(EngineUnavailable("x")).cause == "engine_down"
    assert failures.from_exception(ImageError("x")).cause == "image_missing"
    assert failures.from_exception(EngineCallError("x")).cause == "container_start"
    assert failures.from_exception(ProxyError("x")).cause == "proxy_failure"


def test_retry_delay_doubles_and_honours_retry_after() -> None:
    assert [retry_delay(n, 5) for n in (1, 2, 3, 4)] == [5, 10, 20, 40]
    assert retry_delay(1, 5, retry_after=42) == 42
    assert retry_delay(12, 5) == 600


def test_redaction() -> None:
    cid = "a" * 64
    text = (f"container {cid} failed: Incorrect API key provided: sk-proj-Ab12****xyZ9; "
            "Authorization: Bearer abc.def; token=123456:ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefgh "
            "at http://bob:hunter2@host/v1 with my-own-secret")
    out = redact(text, ("my-own-secret",))
    for bad in (cid, "Ab12", "abc.def", "ABCDEFGHIJ", "hunter2", "my-own-secret"):
        assert bad not in out, (bad, out)
    assert "Incorrect API key provided" in out


def test_every_cause_is_in_the_troubleshooting_page() -> None:
    page = (REPO / "docs" / "troubleshooting.md")
    if not page.exists():
        pytest.skip("docs/troubleshooting.md not written yet")
    text = page.read_text()
    for name in CAUSES:
        assert f"`{name}`" in text, name
    assert re.search(r"mdclaw doctor", text)


def test_the_troubleshooting_page_shows_the_exact_chat_messages() -> None:
    """The page's sample texts are what chat_message says for its sample setup."""
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    ctx = {"base_url": "http://127.0.0.1:11434/v1", "memory": "2g",
           "image": "mdclaw-agent:latest", "backend": "claude", "model_key": "local",
           "limit": "30m"}
    sample = {"model_server_error": dict(http_status=503),
              "context_too_long": dict(limit="8192 tokens"),
              "model_refused": dict(http_status=400, api_message="Invalid model name"),
              "over_budget": dict(api_message="You exceeded your current quota")}
    for c in CAUSES.values():
        f = TurnFailure(c.name, **sample.get(c.name, {}))
        outcome = {TRANSIENT: "retry", CONFIG: "config"}.get(c.policy, "dropped")
        message = chat_message(f, ctx, outcome=outcome, delay=5)
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{c.name}`")), "")
        assert f"| {message} |" in row, (c.name, message)
