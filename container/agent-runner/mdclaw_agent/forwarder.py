"""A loopback TCP port inside the container that leads to the host's proxy socket.

The model SDKs speak HTTP over TCP; the only way out of a `--network=none` container is the
credential proxy's unix socket in the IPC folder. This forwarder listens on 127.0.0.1 (an
ephemeral port) and pipes each connection to that socket, byte for byte, in both directions.
It runs its own event loop in a daemon thread so either backend can use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()


class Forwarder:
    """`with Forwarder(socket_path) as fwd:` gives `fwd.port` on 127.0.0.1."""

    def __init__(self, socket_path: Path, host: str = "127.0.0.1") -> None:
        self.socket_path = Path(socket_path)
        self.host = host
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _handle(self, client_r: asyncio.StreamReader,
                      client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_unix_connection(str(self.socket_path))
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w),
                                 return_exceptions=True)
        except asyncio.CancelledError:
            # Shutdown: end quietly (the stream server inspects a cancelled handler's
            # exception and would log it).
            pass
        finally:
            for w in (up_w, client_w):
                with contextlib.suppress(Exception):
                    w.close()

    async def _main(self) -> None:
        try:
            self._server = await asyncio.start_server(self._handle, self.host, 0)
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as e:  # noqa: BLE001 - reported to the starting thread, re-raised there
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        async with self._server:
            await self._server.serve_forever()

    def start(self) -> Forwarder:
        """Start listening; raises OSError if the port cannot be opened."""
        self._loop = asyncio.new_event_loop()

        loop = self._loop
        assert loop is not None

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                with contextlib.suppress(asyncio.CancelledError):
                    loop.run_until_complete(self._main())
            finally:
                # Let open connections see their cancellation before the loop goes away.
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.close()

        self._thread = threading.Thread(target=run, name="mdclaw-forwarder", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise OSError(f"cannot open the loopback forwarder: {self._error}")
        return self

    def stop(self) -> None:
        if self._loop is None or self._server is None:
            return
        loop, server = self._loop, self._server

        def shutdown() -> None:
            server.close()
            for task in asyncio.all_tasks(loop):
                task.cancel()

        loop.call_soon_threadsafe(shutdown)
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> Forwarder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
