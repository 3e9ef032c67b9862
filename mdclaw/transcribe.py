"""Voice notes as text: a local faster-whisper model, or an OpenAI-compatible endpoint.

`make_transcriber(cfg.transcription)` gives the transcriber the config asks for (None when
`transcription:` is not configured). Both kinds are called with the audio's bytes and run
off the event loop: the local model on a thread (CPU, int8; one transcription at a time, the
model is loaded once on first use), the endpoint over aiohttp. Every failure is a
TranscriptionError whose text is safe to show the agent (it never holds the API key).

faster-whisper is an optional dependency (`pip install 'mdclaw[transcribe]'`), imported only
when the first voice note comes; without it the error says how to install it.
"""

from __future__ import annotations

import asyncio
import importlib
import io
import logging
import threading
from typing import Any, Protocol

import aiohttp

from mdclaw.config import EXTRAS, MissingExtra, Transcription, read_secret
from mdclaw.errors import MdclawError

log = logging.getLogger("mdclaw.transcribe")

MAX_TRANSCRIPT_CHARS = 20_000  # what goes into a prompt at most


class TranscriptionError(MdclawError):
    """The audio could not be transcribed; str(e) says why (no secret in it)."""


class Transcriber(Protocol):
    async def transcribe(self, data: bytes, name: str, mime: str | None) -> str:
        """The text spoken in `data`; raises TranscriptionError."""
        ...


def _clip(text: str) -> str:
    text = " ".join(text.split())
    if len(text) > MAX_TRANSCRIPT_CHARS:
        text = text[:MAX_TRANSCRIPT_CHARS] + " […]"
    return text


class OpenAITranscriber:
    """POST the audio as multipart to `<base_url>/audio/transcriptions` (the OpenAI API, or
    any server speaking it: a local whisper server, a gateway). The key file is read at each
    call, so a rotated key is used without a restart."""

    def __init__(self, cfg: Transcription) -> None:
        self.cfg = cfg
        self.url = cfg.url

    async def transcribe(self, data: bytes, name: str, mime: str | None) -> str:
        headers = {}
        if self.cfg.api_key_file is not None:
            try:
                key = await asyncio.to_thread(read_secret, self.cfg.api_key_file)
            except OSError as e:
                raise TranscriptionError(f"cannot read transcription.api_key_file "
                                         f"{self.cfg.api_key_file}: {e.strerror}") from None
            headers["Authorization"] = f"Bearer {key}"
        form = aiohttp.FormData()
        form.add_field("model", self.cfg.model_name)
        form.add_field("response_format", "json")
        if self.cfg.language:
            form.add_field("language", self.cfg.language)
        form.add_field("file", data, filename=name,
                       content_type=mime or "application/octet-stream")
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout.total_seconds())
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http, \
                    http.post(self.url, data=form, headers=headers) as r:
                status = r.status
                try:
                    body: Any = await r.json(content_type=None)
                except (ValueError, aiohttp.ContentTypeError):
                    body = None
        except TimeoutError:
            raise TranscriptionError(
                f"the transcription service gave no answer within "
                f"{self.cfg.timeout.total_seconds():.0f} s") from None
        except aiohttp.ClientError as e:
            raise TranscriptionError(f"the transcription service cannot be reached "
                                     f"({type(e).__name__})") from None
        if status != 200 or not isinstance(body, dict) or not isinstance(body.get("text"), str):
            detail = ""
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                detail = str(body["error"].get("message") or "")[:200]
            raise TranscriptionError(f"the transcription service answered {status}"
                                     + (f": {detail}" if detail else ""))
        return _clip(body["text"])


class LocalTranscriber:
    """faster-whisper on the CPU with int8 weights. The model (a name faster-whisper knows,
    or the folder of a downloaded model) is loaded on first use and kept."""

    def __init__(self, cfg: Transcription) -> None:
        self.cfg = cfg
        self._model: Any = None
        self._lock = threading.Lock()  # one transcription at a time: it takes every core

    def _load(self) -> Any:
        try:
            module = importlib.import_module("faster_whisper")
        except ImportError:
            missing = MissingExtra("transcription.provider", EXTRAS["transcribe"],
                                   "is not installed")
            raise TranscriptionError(f"{missing.message} (or use provider: openai)") from None
        try:
            return module.WhisperModel(self.cfg.model_name, device="cpu", compute_type="int8")
        except Exception as e:  # noqa: BLE001 - a missing model, a download that failed...
            raise TranscriptionError(f"the faster-whisper model {self.cfg.model_name!r} "
                                     f"could not be loaded: {type(e).__name__}: {e}") from None

    def _run(self, data: bytes) -> str:
        with self._lock:
            if self._model is None:
                self._model = self._load()
            try:
                segments, _info = self._model.transcribe(io.BytesIO(data),
                                                         language=self.cfg.language)
                return _clip(" ".join(s.text for s in segments))
            except Exception as e:  # noqa: BLE001 - undecodable audio and the like
                raise TranscriptionError(f"faster-whisper failed: {type(e).__name__}: "
                                         f"{e}") from None

    async def transcribe(self, data: bytes, name: str, mime: str | None) -> str:
        try:
            return await asyncio.wait_for(asyncio.to_thread(self._run, data),
                                          self.cfg.timeout.total_seconds())
        except TimeoutError:
            raise TranscriptionError(f"transcription took longer than "
                                     f"{self.cfg.timeout.total_seconds():.0f} s") from None


def make_transcriber(cfg: Transcription | None) -> Transcriber | None:
    """The transcriber `transcription:` configures, or None."""
    if cfg is None:
        return None
    if cfg.provider == "local":
        return LocalTranscriber(cfg)
    return OpenAITranscriber(cfg)
