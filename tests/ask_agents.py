"""The fake engine's agent for the ask_agent tests (tests/fake_daemon.py runs it in the daemon).

It reads the one message of its prompt (sender and text) and, by the text:
- `ASK <group> <rest>`: asks that group's agent `<rest>` with the ask_agent action, as the
  agent runner's tool does (a request file in its actions/, the result from
  action_results/), and answers with what it got;
- `FAIL`: ends with exit code 3 and no answer;
- `HANG`: does nothing until the host stops it;
- anything else: answers `<its folder> heard <sender>: <text>`.
Every prompt it is given is appended to `prompts.log` in its group folder, for the test.
"""

from __future__ import annotations

import html
import json
import os
import re
import secrets
import time
from typing import Any

MESSAGE = re.compile(r'<message sender="([^"]*)"[^>]*>(.*?)</message>', re.S)


def _ask(c: Any, group: str, question: str) -> dict[str, Any]:
    rid = f"req-{int(time.time() * 1000)}-{secrets.token_hex(4)}"
    actions = c.ipc_dir / "actions"
    actions.mkdir(exist_ok=True)
    tmp = actions / f".{rid}.tmp"
    tmp.write_text(json.dumps({"type": "action", "request_id": rid, "action": "ask_agent",
                               "params": {"group": group, "question": question,
                                          "timeout": 60}}))
    os.rename(tmp, actions / f"{rid}.json")
    result = c.ipc_dir / "action_results" / f"{rid}.json"
    c.wait_for(result.exists, timeout=120, what=f"the result of {rid}")
    body: dict[str, Any] = json.loads(result.read_text())
    result.unlink()
    return body


def asking_agent(c: Any) -> int:
    folder = c.input.get("groupFolder")
    with (c.group_dir / "prompts.log").open("a") as f:
        f.write(c.prompt + "\n")
    found = MESSAGE.findall(c.prompt)
    sender, text = (html.unescape(found[-1][0]), html.unescape(found[-1][1])) if found else (
        "?", c.prompt)
    if text.startswith("ASK "):
        _, group, rest = text.split(" ", 2)
        body = _ask(c, group, rest)
        if body.get("status") == "success":
            answer = f"{folder} relays: {body['result']['answer']}"
        else:
            answer = f"{folder} relays an error: {body.get('error')}"
    elif text == "FAIL":
        return 3
    elif text == "HANG":
        c.hang(timeout=300)
        return 0
    else:
        answer = f"{folder} heard {sender}: {text}"
    c.say({"status": "success", "result": answer})
    c.wait_closed(timeout=300)
    return 0
