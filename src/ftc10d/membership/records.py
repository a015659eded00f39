"""Membership records: JSON only, HMAC-signed when the job has a token.

Everything membership writes to the store is a small JSON object wrapped as
``{"b": <body>, "s": <hex HMAC-SHA256>}`` (``"s"`` absent without a token),
except heartbeats, which are ``<counter>`` or ``<counter>:<hex HMAC>``. A record over
``COMPRESS_OVER`` bytes (a full configuration of a big job) is stored deflated, ``z`` then
zlib data: every node reads the first configuration of a job at once, from one store.
Nothing read from the store is ever unpickled (design invariant 5): a record is
parsed with :func:`json.loads` and checked for shape, nothing more.

The signature covers the record's *logical key* as well as its body, so a
valid record copied to another key (a heartbeat replayed as another member's,
an old configuration pasted into the next epoch's slot) does not verify.

With a token set, a record whose signature is missing or wrong is ignored and
logged once per (key, value): the reader behaves as if the record were absent
(or, for a configuration slot, as if it were free; see ``agreement.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import zlib
from typing import Any, Optional, Union

from ftc10d.types import InvalidOptionError, MembershipError

logger = logging.getLogger("ftc10d")

#: Environment variable holding the job token (any non-empty string).
TOKEN_ENV = "FTC10D_TOKEN"
#: The biggest record a reader parses (anything bigger is not ours). The biggest legitimate
#: one is a full configuration: ~61 bytes per rank (its member id and handle), 2 MB at 32,768
#: ranks, ~6 MB at 100,000; 32 MiB leaves room for ~500,000 ranks with long host names.
MAX_RECORD_BYTES = 32 << 20
#: Records bigger than this are stored zlib-deflated (level 1), prefixed ``z`` (a JSON record
#: starts with ``{``). Only full configurations of jobs over ~1,000 ranks get there; at 32,768
#: ranks 2 MB becomes ~0.4 MB: 4,096 node agents reading the job's first configuration at once
#: took ~8 GB of unsent replies in the one store process, and it was OOM-killed (docs/benchmarks.md
#: §15). Small records, every record of the usual job, are written exactly as before.
COMPRESS_OVER = 64 << 10
_ZLIB_MARK = b"z"
_MAX_LOGGED = 256  # distinct bad records remembered (and logged) per signer


def resolve_token(token: Union[str, bytes, None]) -> Optional[bytes]:
    """The explicit ``token``, else ``$FTC10D_TOKEN``, else None (unsigned records)."""
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if token is None:
        return None
    raw = token.encode() if isinstance(token, str) else bytes(token)
    if not raw:
        raise InvalidOptionError("the job token is empty; unset it or give a non-empty one")
    return raw


class Signer:
    """Encodes and verifies records for one job (one token, or none)."""

    def __init__(self, token: Union[str, bytes, None] = None) -> None:
        self._key = resolve_token(token)
        #: Names the job key without revealing it ("" unsigned): decoded records are shared by it.
        self.key_id = "" if self._key is None else hashlib.sha256(b"ftc10d-key-id\n" + self._key).hexdigest()[:16]
        self._logged: set[tuple[str, bytes]] = set()
        self.rejected = 0  # records ignored for a bad signature or a bad shape (tests read it)

    @property
    def signed(self) -> bool:
        return self._key is not None

    def _mac(self, key: str, body: bytes) -> str:
        assert self._key is not None
        return hmac.new(self._key, key.encode() + b"\n" + body, hashlib.sha256).hexdigest()

    def encode(self, key: str, body: dict[str, Any]) -> bytes:
        """Serialize ``body`` for ``key`` (canonical JSON, so the MAC is reproducible)."""
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        out: dict[str, Any] = {"b": body}
        if self._key is not None:
            out["s"] = self._mac(key, text.encode())
        raw = json.dumps(out, sort_keys=True, separators=(",", ":")).encode()
        if len(raw) > MAX_RECORD_BYTES:
            # Written, every reader would refuse it: the job would wait for a record nobody
            # accepts. Fail where it is written, with the size.
            raise MembershipError(
                f"membership record {key!r} is {len(raw)} bytes, over the limit of {MAX_RECORD_BYTES} "
                f"(ftc10d.membership.records.MAX_RECORD_BYTES): a configuration of this many ranks is "
                f"beyond what one record holds; use shorter host names or fewer ranks per job")
        if len(raw) > COMPRESS_OVER:
            return _ZLIB_MARK + zlib.compress(raw, 1)
        return raw

    def decode(self, key: str, raw: Optional[bytes]) -> Optional[dict[str, Any]]:
        """The body of ``raw`` if it is a well-formed record for ``key`` with a good
        signature (when a token is set); None otherwise (logged once)."""
        if raw is None:
            return None
        if len(raw) > MAX_RECORD_BYTES:
            self._reject(key, raw[:64], f"record of {len(raw)} bytes is too big")
            return None
        if raw[:1] == _ZLIB_MARK:
            # Inflated to at most the limit: a small record that inflates to gigabytes is refused
            # like a big one, never held in memory.
            packed, inflate = raw, zlib.decompressobj()
            try:
                raw = inflate.decompress(packed[1:], MAX_RECORD_BYTES + 1)
            except zlib.error:
                self._reject(key, packed[:64], "not a valid deflated record")
                return None
            if len(raw) > MAX_RECORD_BYTES or inflate.unconsumed_tail:
                self._reject(key, packed[:64], f"deflated record inflates past {MAX_RECORD_BYTES} bytes")
                return None
            if not inflate.eof:
                self._reject(key, packed[:64], "truncated deflated record")
                return None
        try:
            outer = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            self._reject(key, raw, "not JSON")
            return None
        if not isinstance(outer, dict) or not isinstance(outer.get("b"), dict):
            self._reject(key, raw, "not a membership record")
            return None
        body: dict[str, Any] = outer["b"]
        if self._key is not None:
            sig = outer.get("s")
            text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
            # compare bytes: compare_digest raises TypeError on a str that is not ASCII
            if not isinstance(sig, str) or not hmac.compare_digest(sig.encode(errors="replace"),
                                                                   self._mac(key, text).encode()):
                self._reject(key, raw, "missing signature" if sig is None else "bad signature")
                return None
        return body

    # Heartbeats are the one high-rate record (every member, 10 times a second, read in
    # bulk by detectors): a fixed format, ``<counter>`` or ``<counter>:<hex MAC>``, that
    # costs an int() to read rather than a JSON parse.

    def encode_beat(self, key: str, n: int) -> bytes:
        text = str(int(n))
        if self._key is None:
            return text.encode()
        return f"{text}:{self._mac(key, text.encode())}".encode()

    def decode_beat(self, key: str, raw: Optional[bytes]) -> Optional[int]:
        """The counter of a heartbeat record, or None (absent, malformed, bad signature)."""
        if raw is None:
            return None
        text, _, sig = raw.partition(b":")
        if not text.isdigit() or len(text) > 19:
            self._reject(key, raw, "not a heartbeat")
            return None
        if self._key is not None and not (sig and hmac.compare_digest(sig, self._mac(key, text).encode())):
            self._reject(key, raw, "missing signature" if not sig else "bad signature")
            return None
        return int(text)

    def _reject(self, key: str, raw: bytes, why: str) -> None:
        self.rejected += 1
        mark = (key, raw[:256])
        if mark in self._logged:
            return
        if len(self._logged) < _MAX_LOGGED:
            self._logged.add(mark)
        logger.warning("membership: ignored the record at %r: %s (%d bytes)", key, why, len(raw))
