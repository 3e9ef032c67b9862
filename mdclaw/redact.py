"""Removing a secret from bytes on their way out, also when it is split across chunks.

The credential proxy (mdclaw.proxy) sends the model key upstream on every request; an
upstream that echoes what it was sent (a misconfigured `base_url`, a debugging proxy, a
compromised endpoint) would hand the key to the agent in its answer. `Redactor` replaces
every occurrence of the key in a stream of chunks with `MARKER`, holding back only the tail
of a chunk that could be the start of one (at most the longest form's length minus one
byte, and in practice nothing: an ordinary chunk does not end in the first bytes of a key),
so an answer still streams as it comes.

The forms looked for, from each secret (`secret_forms`):

- the secret as it is: this also covers the `Bearer <key>` header value, a JSON string or a
  URL holding the key (keys are letters, digits, `-` and `_`, which neither escapes), and
  any text that quotes the header;
- its JSON-escaped and its percent-encoded spellings, when they differ from it (a key with
  `/`, `+`, `=` or other characters those encodings change);
- its base64 encodings (standard and URL-safe alphabets) at each of the three alignments it
  can have inside a longer base64 text (an echo of `x-api-key: <key>` or of a Basic
  credential), as the run of characters that only the key's bytes decide.

Not covered: encodings that would need the echo's surroundings to recognise (hex, other
character sets, compression: the proxy asks for and reads answers uncompressed), and a key
cut into pieces by the echo itself. A secret shorter than MIN_SECRET bytes is not looked for
(it would match ordinary text: such a string is no secret worth the name).
"""

from __future__ import annotations

import base64
import json
import urllib.parse
from collections.abc import Iterable

MARKER = b"[mdclaw: credential removed]"
MIN_SECRET = 8
# base64 characters before the first one that only the secret's bytes decide, when the
# secret starts 0, 1 or 2 bytes into a 3-byte group.
_B64_SKIP = (0, 2, 3)
_MIN_B64_FORM = 8


def secret_forms(secret: str) -> list[bytes]:
    """The byte strings `Redactor` removes for `secret`, longest first (see the module)."""
    if len(secret.encode()) < MIN_SECRET:
        return []
    raw = secret.encode()
    forms = {raw, json.dumps(secret)[1:-1].encode(), json.dumps(secret, ensure_ascii=False)
             [1:-1].encode(), urllib.parse.quote(secret, safe="").encode(),
             urllib.parse.quote_plus(secret, safe="").encode()}
    forms |= {f.replace(b"/", b"\\/") for f in list(forms)}
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + raw)
        whole = (shift + len(raw)) // 3 * 4  # characters of complete 3-byte groups
        core = encoded[_B64_SKIP[shift]:whole]
        if len(core) >= _MIN_B64_FORM:
            forms.add(core)
            forms.add(core.translate(bytes.maketrans(b"+/", b"-_")))
    return sorted(forms, key=lambda f: (-len(f), f))


def all_forms(secrets: Iterable[str]) -> list[bytes]:
    """The forms of every secret in `secrets`, longest first."""
    return sorted({f for s in secrets for f in secret_forms(s)}, key=lambda f: (-len(f), f))


class Redactor:
    """Replaces every one of `forms` (all_forms of the secrets) in a stream of chunks:
    `feed` each chunk and send what it returns, then send `finish()`; `scrub` does one
    string (a header value)."""

    def __init__(self, forms: Iterable[bytes]) -> None:
        self.forms = sorted(set(forms), key=lambda f: (-len(f), f))
        self._held = b""

    def __bool__(self) -> bool:
        return bool(self.forms)

    def feed(self, chunk: bytes) -> bytes:
        """The part of everything fed so far that can be sent now, with the secret's forms
        replaced; a tail that may be the start of one is kept for the next chunk."""
        if not self.forms:
            return chunk
        data = self._held + chunk
        for form in self.forms:
            if form in data:
                data = data.replace(form, MARKER)
        cut = self._cut(data)
        self._held = data[cut:]
        return data[:cut]

    def finish(self) -> bytes:
        """What was held back: the stream ended, so it cannot be the start of a form."""
        held, self._held = self._held, b""
        return held

    def scrub(self, text: str) -> str:
        """`text` (a header value, a reason phrase) with every form replaced."""
        if not self.forms:
            return text
        data = text.encode("utf-8", "surrogateescape")
        for form in self.forms:
            data = data.replace(form, MARKER)
        return data.decode("utf-8", "surrogateescape")

    def _cut(self, data: bytes) -> int:
        """Where the longest tail of `data` that is the start of some form begins (the
        length of `data` when no tail is)."""
        cut = len(data)
        for form in self.forms:
            first = form[:1]
            i = data.find(first, max(0, len(data) - len(form) + 1))
            while i != -1 and i < cut:
                if form.startswith(data[i:]):
                    cut = i
                    break
                i = data.find(first, i + 1)
        return cut
