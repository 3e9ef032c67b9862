"""A scripted OpenAI-compatible model server for mdclaw's NixOS VM test.

Answers every POST .../chat/completions with one fixed assistant message and appends each
request's path and Authorization header to a log, so the test can check that the real key
reached "the provider" through mdclaw's credential proxy. Standard library only.

    python3 vm-test-fake-model.py PORT LOGFILE
"""

from __future__ import annotations

import http.server
import json
import sys

REPLY = "Hello from the fake model"


class Handler(http.server.BaseHTTPRequestHandler):
    log_path = "requests.log"

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._send(200, {"status": "ok"})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(json.dumps({"path": self.path,
                                  "authorization": self.headers.get("Authorization", ""),
                                  "bytes": len(raw)}) + "\n")
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self._send(404, {"error": {"message": f"no route {self.path}"}})
            return
        try:
            model = json.loads(raw or b"{}").get("model", "fake-model")
        except ValueError:
            self._send(400, {"error": {"message": "body is not JSON"}})
            return
        self._send(200, {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": REPLY}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6},
        })


def main(argv: list[str]) -> None:
    port = int(argv[1]) if len(argv) > 1 else 8080
    Handler.log_path = argv[2] if len(argv) > 2 else "requests.log"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"fake model listening on 127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv)
