"""A stand-in agent for the end-to-end tests, run inside the test image.

`python3 /opt/fake_agent.py MODE ARGS...`; it reads the ContainerInput on stdin (like the real
runner) and prints marked blocks. Standard library only: the image has nothing else.
"""

import json
import os
import socket
import sys
import time

START, END = "---NANOCLAW_OUTPUT_START---", "---NANOCLAW_OUTPUT_END---"


def emit(body):
    sys.stdout.write(f"{START}\n{json.dumps(body)}\n{END}\n")
    sys.stdout.flush()


def can_write(path):
    try:
        with open(os.path.join(path, f".probe-{os.getpid()}"), "w") as f:
            f.write("x")
        os.unlink(os.path.join(path, f".probe-{os.getpid()}"))
        return True
    except OSError:
        return False


def status_field(name):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    return None


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    stdin = sys.stdin.read()
    if mode == "blocks":
        count, interval = int(args[0]), float(args[1])
        for i in range(count):
            emit({"i": i, "t": time.time(), "stdin_len": len(stdin)})
            if i < count - 1:
                time.sleep(interval)
    elif mode == "sleep":
        time.sleep(float(args[0]))
    elif mode == "idle":
        emit({"status": "success", "result": "first"})
        close = "/workspace/ipc/input/_close"
        while not os.path.exists(close):
            time.sleep(0.1)
        emit({"status": "success", "result": "closed"})
    elif mode == "flood":
        total, chunk = int(args[0]), b"x" * 65536 + b"\n"
        out = sys.stdout.buffer
        written = 0
        while written < total:
            out.write(chunk)
            written += len(chunk)
        out.flush()
        emit({"after_flood": written})
    elif mode == "bigblock":
        sys.stdout.write(START + "\n" + "y" * int(args[0]) + "\n" + END + "\n")
        emit({"small": True})
    elif mode == "net":
        result = {"ifaces": [name for _, name in socket.if_nameindex()]}
        for host, port in (("1.1.1.1", 53), ("10.0.2.2", 80), ("8.8.8.8", 443)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(2)
            try:
                s.connect((host, port))
                result[f"{host}:{port}"] = "connected"
            except OSError as e:
                result[f"{host}:{port}"] = f"error {e.errno}"
            finally:
                s.close()
        try:
            socket.getaddrinfo("deb.debian.org", 80)
            result["dns"] = "resolved"
        except OSError as e:
            result["dns"] = f"error {e}"
        emit(result)
    elif mode == "whoami":
        extra = "/workspace/extra"
        emit({
            "uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
            "root_writable": can_write("/"), "etc_writable": can_write("/etc"),
            "tmp_writable": can_write("/tmp"),
            "group_writable": can_write("/workspace/group"),
            "ipc_writable": can_write("/workspace/ipc"),
            "global_writable": can_write("/workspace/global"),
            "claude_writable": can_write(os.path.expanduser("~/.claude")),
            "settings": os.path.exists(os.path.expanduser("~/.claude/settings.json")),
            "extra": {d: sorted(os.listdir(os.path.join(extra, d)))
                      for d in (sorted(os.listdir(extra)) if os.path.isdir(extra) else [])},
            "extra_writable": {d: can_write(os.path.join(extra, d))
                               for d in (os.listdir(extra) if os.path.isdir(extra) else [])},
            "cap_eff": status_field("CapEff"), "no_new_privs": status_field("NoNewPrivs"),
            "stdin": json.loads(stdin) if stdin else None,
            "env": {k: v for k, v in os.environ.items() if k not in ("PATH",)},
        })
        if args and args[0] == "until-close":
            # Stay up until the test has looked at the running container (it writes _close).
            close, deadline = "/workspace/ipc/input/_close", time.monotonic() + 120
            while not os.path.exists(close) and time.monotonic() < deadline:
                time.sleep(0.05)
    elif mode == "exit":
        emit({"exiting": int(args[0])})
        sys.exit(int(args[0]))
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
