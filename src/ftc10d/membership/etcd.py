"""etcd backend (etcd 3.4+, through its JSON gateway with ``etcd3gw``), for HA.

An etcd cluster of three (or five) members survives the loss of one (two), and
its Raft log makes every write linearizable: a client cut off from the etcd
quorum (a partitioned minority) cannot write at all, so it can never form a
configuration of its own.

- **Epoch bump**: a transaction ``compare(create_revision(cfg/<e>) == 0) ->
  put`` (its failure branch reads the winner, one round trip either way).
- **Liveness**: each member holds a lease (``lease_ttl``, 3 s by default; etcd
  may round it up to its own minimum, 1.5x its election timeout). Its member
  record, heartbeat and join entry are attached to it and vanish when it is no
  longer renewed; a vanished heartbeat is a lapse at once. Leases are coarse
  (whole seconds, expiry checked every 500 ms by etcd) and a leader election
  stalls their renewal, so the heartbeat counters, judged by the members'
  detectors, are what meets a 1 s timeout; the lease is the backstop (a member
  nobody watches any more still disappears) and the garbage collector.
- **Watches**: :meth:`EtcdMembershipStore.wait_for` watches the next
  configuration's key from the revision it read, so the event cannot be missed.
- **Joins**: ``join/<id>`` keys; the key's ``create_revision`` is its sequence number.
- **Failover**: requests go to one endpoint; on a connection error, a timeout
  or a 5xx they move on to the next. Reads are linearizable (etcd's default).

``etcd3gw`` is used because it is pure Python on top of ``requests`` (no gRPC
or protobuf build, works with etcd 3.3-3.6), and its JSON gateway keeps
invariant 5 trivially true: nothing but JSON crosses the wire. The watch
stream is read here directly (``requests`` with a read timeout) because
etcd3gw's watcher has no bound on a connect that hangs.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import threading
import time
from typing import Any, Callable, Iterator, Optional, Union

import requests

from ftc10d.membership.store import Head, MembershipStore, count_request
from ftc10d.types import InvalidOptionError, MembershipError, StoreUnavailableError

logger = logging.getLogger("ftc10d")

DEFAULT_PREFIX = "/ftc10d/membership/"


def _b64(data: Union[str, bytes]) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(data: str) -> bytes:
    return base64.b64decode(data)


def _range_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return _b64(bytes(raw))


#: A decoded watch event: (type, key, value, mod_revision).
_Event = tuple[str, bytes, bytes, int]


def _parse_endpoint(ep: str) -> tuple[str, int, str]:
    proto = "http"
    if "://" in ep:
        proto, ep = ep.split("://", 1)
    host, _, port = ep.rstrip("/").rpartition(":")
    return host.strip("[]"), int(port), proto


class _Lease:
    """A member's lease, shared by the clones of its store (one per thread)."""

    def __init__(self, ttl: int) -> None:
        self.ttl = ttl
        self.id: Optional[int] = None
        self.lost = False
        self.borrowed = False  # another process's (a node agent's): never renewed nor revoked here
        self.lock = threading.Lock()


class EtcdMembershipStore(MembershipStore):
    """A connection to an etcd cluster: ``endpoints`` like ``["http://127.0.0.1:2379", ...]``."""

    kind = "etcd"

    def __init__(
        self,
        endpoints: Union[str, list[str]],
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout: float = 2.0,
        lease_ttl: float = 3.0,
        _lease: Optional[_Lease] = None,
    ) -> None:
        import etcd3gw  # noqa: F401  (the dependency this backend is documented to use)

        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e]
        if not endpoints:
            raise InvalidOptionError("give at least one etcd endpoint, e.g. [\"http://127.0.0.1:2379\"]")
        self.endpoints = list(endpoints)
        self.prefix = prefix
        self.timeout = timeout
        self._lease = _lease or _Lease(max(1, math.ceil(lease_ttl)))
        self._clients: dict[int, Any] = {}
        self._idx = 0
        self.connection_epoch = 0

    def clone(self) -> "EtcdMembershipStore":
        return EtcdMembershipStore(self.endpoints, prefix=self.prefix, timeout=self.timeout, _lease=self._lease)

    def describe(self) -> str:
        return f"etcd://{','.join(self.endpoints)}{self.prefix}"

    # ---------------------------------------------------------------- transport

    def _client(self, i: int) -> Any:
        import etcd3gw

        c = self._clients.get(i)
        if c is None:
            host, port, proto = _parse_endpoint(self.endpoints[i])
            c = etcd3gw.Etcd3Client(host=host, port=port, protocol=proto, timeout=self.timeout, api_path="/v3/")
            self._clients[i] = c
        return c

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        from etcd3gw import exceptions as ex

        errors = []
        n = len(self.endpoints)
        count_request()
        for attempt in range(n):
            i = (self._idx + attempt) % n
            client = self._client(i)
            try:
                out = client.post(client.get_url(path), json=payload)
                self._idx = i
                return out
            except (ex.ConnectionFailedError, ex.ConnectionTimeoutError, ex.InternalServerError,
                    requests.RequestException) as exc:
                errors.append(f"{self.endpoints[i]}: {type(exc).__name__} {getattr(exc, 'detail_text', '') or exc}")
                self._clients.pop(i, None)  # drop its (possibly wedged) connection pool
            except ex.Etcd3Exception as exc:
                text = getattr(exc, "detail_text", "") or str(exc)
                if "lease not found" in text:
                    raise _LeaseNotFound(text) from exc
                if "request is too large" in text:
                    size = len(json.dumps(payload))
                    raise MembershipError(
                        f"etcd {self.endpoints[i]} refused a {size}-byte request ({text}): a full configuration "
                        "record lists every rank (~40 bytes each once deflated and base64-encoded), past etcd's "
                        "--max-request-bytes (1.5 MiB by default) above ~40,000 ranks. Start etcd with "
                        "--max-request-bytes=8388608 (8 MiB).") from exc
                errors.append(f"{self.endpoints[i]}: {text}")
        raise StoreUnavailableError(f"etcd {self.describe()} unavailable: " + "; ".join(errors)[:600])

    def _k(self, key: str) -> str:
        return self.prefix + key

    # ------------------------------------------------------------------- lease

    def _lease_id(self) -> int:
        lease = self._lease
        with lease.lock:
            if lease.id is None:
                out = self._post("/lease/grant", {"TTL": lease.ttl, "ID": 0})
                lease.id = int(out["ID"])
                logger.debug("etcd lease %x granted (ttl %s s)", lease.id, out.get("TTL"))
            return lease.id

    def lease(self) -> Optional[int]:
        return self._lease_id()

    def lease_at_least(self, seconds: float) -> None:
        with self._lease.lock:
            if self._lease.id is None and not self._lease.borrowed:
                self._lease.ttl = max(self._lease.ttl, math.ceil(seconds))

    def borrow_lease(self, lease_id: int) -> None:
        with self._lease.lock:
            self._lease.id = int(lease_id)
            self._lease.borrowed = True

    def _regrant(self) -> int:
        with self._lease.lock:
            self._lease.id = None
            self._lease.lost = True
            self._lease.borrowed = False
        logger.warning("membership: etcd lease expired; granting a new one")
        return self._lease_id()

    def keepalive(self) -> None:
        if self._lease.id is None or self._lease.borrowed:
            return
        try:
            out = self._post("/lease/keepalive", {"ID": self._lease.id})
        except _LeaseNotFound:
            self._regrant()
            return
        if int(out.get("result", {}).get("TTL", -1)) <= 0:
            self._regrant()

    def revoke(self) -> None:
        lease = self._lease
        if lease.id is None or lease.borrowed:
            lease.id = None
            return
        try:
            self._post("/kv/lease/revoke", {"ID": lease.id})
        except Exception:
            logger.debug("etcd lease revoke failed", exc_info=True)
        lease.id = None

    @property
    def lease_lost(self) -> bool:
        lost, self._lease.lost = self._lease.lost, False
        return lost

    # -------------------------------------------------------------------- keys

    def _range(self, key: str, **extra: Any) -> dict[str, Any]:
        return self._post("/kv/range", {"key": _b64(self._k(key)), **extra})

    def get(self, key: str) -> Optional[bytes]:
        kvs = self._range(key).get("kvs") or []
        return _unb64(kvs[0].get("value", "")) if kvs else None

    def get_many(self, keys: list[str]) -> list[Optional[bytes]]:
        if not keys:
            return []
        out = self._post("/kv/txn", {"success": [{"request_range": {"key": _b64(self._k(k))}} for k in keys]})
        values: list[Optional[bytes]] = []
        for resp in out.get("responses", []):
            kvs = resp.get("response_range", {}).get("kvs") or []
            values.append(_unb64(kvs[0].get("value", "")) if kvs else None)
        return values

    def put(self, key: str, value: bytes, *, leased: bool = False) -> None:
        payload: dict[str, Any] = {"key": _b64(self._k(key)), "value": _b64(value)}
        if leased:
            payload["lease"] = self._lease_id()
        try:
            self._post("/kv/put", payload)
        except _LeaseNotFound:
            payload["lease"] = self._regrant()
            self._post("/kv/put", payload)

    def exists(self, key: str) -> bool:
        return int(self._range(key, count_only=True).get("count", 0)) > 0

    def _cas(self, key: str, compare: dict[str, Any], value: bytes) -> tuple[bool, bytes]:
        k = _b64(self._k(key))
        out = self._post("/kv/txn", {
            "compare": [{"key": k, **compare}],
            "success": [{"request_put": {"key": k, "value": _b64(value)}}],
            "failure": [{"request_range": {"key": k}}],
        })
        if out.get("succeeded"):
            return True, value
        kvs = (out.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        return False, _unb64(kvs[0].get("value", "")) if kvs else b""

    def create(self, key: str, value: bytes) -> tuple[bool, bytes]:
        return self._cas(key, {"result": "EQUAL", "target": "CREATE", "create_revision": "0"}, value)

    def replace(self, key: str, expected: bytes, value: bytes) -> tuple[bool, bytes]:
        return self._cas(key, {"result": "EQUAL", "target": "VALUE", "value": _b64(expected)}, value)

    lists_keys = True

    def highest(self, prefix: str) -> Optional[tuple[int, bytes]]:
        out = self._post("/kv/range", {"key": _b64(self._k(prefix)), "range_end": _range_end(self._k(prefix)),
                                       "sort_order": "DESCEND", "sort_target": "KEY", "limit": 1})
        kvs = out.get("kvs") or []
        if not kvs:
            return None
        try:
            return int(_unb64(kvs[0]["key"]).decode().rsplit("/", 1)[-1]), _unb64(kvs[0].get("value", ""))
        except ValueError:
            return None

    def read_head(self, joins_after: int) -> Optional[Head]:
        def top(prefix: str) -> dict[str, Any]:
            p = self._k(prefix)
            return {"request_range": {"key": _b64(p), "range_end": _range_end(p), "sort_order": "DESCEND",
                                      "sort_target": "KEY", "limit": 1}}

        j = self._k("join/")
        out = self._post("/kv/txn", {"success": [
            top("cfg/"), top("pending/"),
            {"request_range": {"key": _b64(j), "range_end": _range_end(j), "keys_only": True,
                               "min_create_revision": joins_after + 1, "sort_order": "ASCEND",
                               "sort_target": "CREATE"}},
        ]})
        ranges = [r.get("response_range", {}).get("kvs") or [] for r in out.get("responses", [])]
        if len(ranges) != 3:
            return None

        def slot(kvs: list[dict[str, Any]]) -> Optional[tuple[int, bytes]]:
            if not kvs:
                return None
            try:
                return int(_unb64(kvs[0]["key"]).decode().rsplit("/", 1)[-1]), _unb64(kvs[0].get("value", ""))
            except ValueError:
                return None

        joins = [(int(kv["create_revision"]), _unb64(kv["key"]).decode()[len(j):]) for kv in ranges[2]]
        return Head(slot(ranges[0]), slot(ranges[1]), joins)

    # ------------------------------------------------------------------- joins

    def append_join(self, member_id: str) -> None:
        self.put(f"join/{member_id}", b"1", leased=True)

    def read_joins(self, after: int) -> list[tuple[int, str]]:
        p = self._k("join/")
        out = self._post("/kv/range", {"key": _b64(p), "range_end": _range_end(p), "keys_only": True,
                                       "min_create_revision": after + 1, "sort_order": "ASCEND",
                                       "sort_target": "CREATE"})
        joins = []
        for kv in out.get("kvs") or []:
            joins.append((int(kv["create_revision"]), _unb64(kv["key"]).decode()[len(p):]))
        return joins

    # ----------------------------------------------------------------- waiting

    def wait_for(self, key: str, timeout: float, stop: Optional[threading.Event] = None) -> Optional[bytes]:
        first = self._range(key)
        kvs = first.get("kvs") or []
        if kvs:
            return _unb64(kvs[0].get("value", ""))
        revision = int(first.get("header", {}).get("revision", 0))
        return self._watch_once(key, revision + 1, timeout)

    def _watch_once(self, key: str, start_revision: int, timeout: float) -> Optional[bytes]:
        """One watch stream from ``start_revision``: the first put of ``key``, or None."""
        body = {"create_request": {"key": _b64(self._k(key)), "start_revision": start_revision}}
        for _, events in self._watch_stream(body, max(timeout, 0.01)):
            for kind, _key, value, _rev in events:
                if kind == "PUT":
                    return value
        return None

    def _watch_stream(self, body: dict[str, Any], quiet: float) -> Iterator[tuple[dict[str, Any], list[_Event]]]:
        """Open one watch stream (``body``: its create request) and yield each message's
        ``result`` with its events decoded, ``(type, key, value, mod_revision)`` (``{}`` and no
        events for a keep-alive line, so that the caller can look at its stop flag); it ends
        without error once nothing came for ``quiet`` seconds. Raises
        :class:`StoreUnavailableError` (and moves to the next endpoint) if the watch fails or
        sends what does not decode."""
        host, port, proto = _parse_endpoint(self.endpoints[self._idx])
        url = f"{proto}://{host}:{port}/v3/watch"
        count_request()  # a watch stream opened
        try:
            with requests.post(url, json=body, stream=True, timeout=(self.timeout, quiet)) as resp:
                for line in resp.iter_lines():
                    result = json.loads(line).get("result", {}) if line.strip() else {}
                    events = [(e.get("type", "PUT"), _unb64(e["kv"].get("key", "")), _unb64(e["kv"].get("value", "")),
                               int(e["kv"].get("mod_revision", 0))) for e in result.get("events") or []]
                    yield result, events
        except (requests.RequestException, ValueError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, requests.exceptions.ReadTimeout) or (
                    "timed out" in str(exc).lower() and not isinstance(exc, requests.exceptions.ConnectTimeout)):
                return  # quiet: a streamed read timing out surfaces as a ConnectionError too
            self._idx = (self._idx + 1) % len(self.endpoints)
            raise StoreUnavailableError(f"etcd watch on {url} failed: {exc}") from exc

    def read_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every key under ``prefix`` (relative to the store's prefix) and its value, in one
        range request (a monitor's read of every heartbeat; a txn is capped at 128 keys)."""
        p = self._k(prefix)
        out = self._post("/kv/range", {"key": _b64(p), "range_end": _range_end(p)})
        return {_unb64(kv["key"]).decode(errors="replace")[len(self.prefix):]: _unb64(kv.get("value", ""))
                for kv in out.get("kvs") or []}

    def watch_prefix(self, prefix: str, on_put: Callable[[str, bytes, float], None],
                     stop: threading.Event, idle: float = 1.0) -> None:
        """Stream every put under ``prefix`` to ``on_put(key, value, arrival)`` (the key relative
        to the store's prefix; ``arrival`` on ``time.monotonic``) until ``stop`` is set, checked
        after each event and at least every ``idle`` seconds. A stream that ends or goes quiet
        for ``idle`` is reopened from the revision after the last event seen: nothing put in
        between is missed (unless etcd compacted it away: then from the present). Raises
        :class:`StoreUnavailableError` if no endpoint takes the watch."""
        p = self._k(prefix)
        start: Optional[int] = None
        while not stop.is_set():
            if start is None:
                head = self._post("/kv/range", {"key": _b64(p), "range_end": _range_end(p), "count_only": True})
                start = int(head.get("header", {}).get("revision", 0)) + 1
            body = {"create_request": {"key": _b64(p), "range_end": _range_end(p), "start_revision": start}}
            for result, events in self._watch_stream(body, idle):  # ends when quiet for ``idle``: reopened
                if stop.is_set():
                    return
                if result.get("canceled") or int(result.get("compact_revision", 0) or 0):
                    start = None  # compacted past ``start``: go on from the present
                    break
                now = time.monotonic()
                for kind, k, value, rev in events:
                    start = max(start, rev + 1)
                    if kind == "PUT":
                        on_put(k.decode(errors="replace")[len(self.prefix):], value, now)

    def close(self) -> None:
        for c in self._clients.values():
            try:
                c.session.close()
            except Exception:
                pass
        self._clients.clear()


class _LeaseNotFound(Exception):
    """etcd answered that our lease no longer exists (it expired)."""
