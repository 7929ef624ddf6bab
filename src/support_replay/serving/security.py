"""What the engine server and the router refuse before a handler runs (docs/reliability.md).

- ``BodyLimit``: an ASGI middleware that counts the bytes of a request body as they arrive,
  chunked or not, and answers 413 as soon as the limit is passed (nothing beyond it is read).
- ``JSONOnly``: mutating routes take ``application/json`` only (415 otherwise), so a web page
  cannot post a "simple" ``text/plain`` request across origins.
- Host checking is starlette's ``TrustedHostMiddleware`` (``allowed_hosts``).
- ``Keys``: a generation key and an admin key, from an environment variable or a file (a flag
  value would show in ``ps``), compared in constant time; ``KeyGuard`` asks for them per route.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

API_KEY_ENV = "SUPPORT_REPLAY_API_KEY"
ADMIN_KEY_ENV = "SUPPORT_REPLAY_ADMIN_KEY"
# the keys a hop (router, sessions) presents to the engines behind it: its own, never its clients'
UPSTREAM_API_KEY_ENV = "SUPPORT_REPLAY_UPSTREAM_API_KEY"
UPSTREAM_ADMIN_KEY_ENV = "SUPPORT_REPLAY_UPSTREAM_ADMIN_KEY"
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "::1", "[::1]"]


WEIGHTS_OVER_HTTP = "/update_weights_from_safetensors"  # ours: the weights in the body, no shared filesystem
# the routes that change an engine's state: the admin key guards them, our router sends them to every engine
ADMIN_PATHS = (
    "/update_weights_from_disk",
    WEIGHTS_OVER_HTTP,
    "/update_weight_version",
    "/flush_cache",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
)
# vLLM 0.32's routes that change a server's state (its dev-mode /collective_rpc, its RL pause and resume, its run-time
# adapters; read from its wheel, entrypoints/rl/online/api_router.py): a router in front of vLLM servers broadcasts
# them with the admin key
VLLM_ADMIN_PATHS = ("/pause", "/resume", "/collective_rpc", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
DEFAULT_MAX_WEIGHTS_BYTES = 64 * 2**30


async def _send_error(send: Send, status: int, message: str, headers: list | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """413 once a body passes ``max_bytes``, whether it declared its length or arrived chunked.

    Past the limit the 413 goes out at once, the application sees the client disconnect, and
    whatever it would still send is dropped: nothing more of the body is read.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, per_path: dict[str, int] | None = None):
        self.app, self.default_bytes, self.per_path = app, int(max_bytes), dict(per_path or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        max_bytes = self.per_path.get(scope["path"], self.default_bytes)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
            return await _send_error(send, 413, f"request body larger than {max_bytes} bytes")
        seen, refused = 0, False

        async def counting() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    refused = True
                    await _send_error(send, 413, f"request body larger than {max_bytes} bytes")
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message: Message) -> None:
            if not refused:
                await send(message)

        try:
            await self.app(scope, counting, guarded)
        except Exception:  # the app reacting to the disconnect we made up: the 413 is out already
            if not refused:
                raise


class JSONOnly:
    """415 for a POST whose content type is not ``application/json``.

    A POST with neither a body nor a content type (``/flush_cache`` as SGLang clients call it)
    passes when it comes from no web page: there is nothing in it for a handler to read, but a page on
    any site may send it across origins without asking (a keyless loopback engine's cache was flushable
    so); browsers name the page in ``Origin`` on every POST, and HTTP clients send none. ``binary_paths`` take
    ``application/octet-stream`` instead, and only behind a key: a web page can post such a body
    across origins without asking, so without a key to stop it they answer 403.
    """

    def __init__(self, app: ASGIApp, binary_paths: tuple[str, ...] = (), keyed: bool = False):
        self.app, self.binary_paths, self.keyed = app, tuple(binary_paths), keyed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.binary_paths:
            ctype = dict(scope.get("headers") or []).get(b"content-type", b"").split(b";")[0].strip().lower()
            if not self.keyed:
                return await _send_error(
                    send,
                    403,
                    f"{scope['path']} takes a binary body, so it needs the admin key: start the server with "
                    "--admin-key-file",
                )
            if ctype != b"application/octet-stream":
                return await _send_error(
                    send,
                    415,
                    f"content-type must be application/octet-stream, got {ctype.decode(errors='replace') or 'none'}",
                )
            return await self.app(scope, receive, send)
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = dict(scope.get("headers") or [])
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            empty = (
                b"content-type" not in headers
                and headers.get(b"content-length", b"0") == b"0"
                and b"transfer-encoding" not in headers
                and b"origin" not in headers
            )
            if ctype != b"application/json" and not empty:
                return await _send_error(
                    send, 415, f"content-type must be application/json, got {ctype.decode(errors='replace') or 'none'}"
                )
        return await self.app(scope, receive, send)


class NormalPaths:
    """400 for a path that is not in normal form: ``.`` or ``..`` segments, empty segments, a backslash,
    an encoded slash, dot or backslash, or a decoded ``?``, ``#`` or ``%``. Guards match paths as written, and a
    client library (httpx) or a proxy may normalise ``/v1/../update_weight_version`` into an admin route after the
    guard has looked, or parse a forwarded ``/update_weight_version?`` (sent as ``%3F``) again and drop what follows
    the ``?``: such paths never pass, so the path a guard checks is the path that is sent on."""

    ENCODED = (b"%2f", b"%2e", b"%5c")
    RESERVED = ("?", "#", "%")  # in the decoded path: an encoded query, fragment or second escape

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path, raw = scope["path"], (scope.get("raw_path") or b"").lower()
            segments = path.split("/")[1:]
            odd = (
                any(seg in (".", "..") for seg in segments)
                or "//" in path
                or "\\" in path
                or any(e in raw for e in self.ENCODED)
                or any(c in path for c in self.RESERVED)
            )
            if odd or not path.startswith("/"):
                return await _send_error(
                    send,
                    400,
                    f"path {path[:200]!r} is not in normal form (no '.', '..', '//', backslash, encoded separators, "
                    "or an encoded '?', '#' or '%')",
                )
        return await self.app(scope, receive, send)


class KeyGuard:
    """401 unless the request carries the key its route needs (``admin_paths`` the admin key, the
    rest the API key, ``open_paths`` none). A plain ASGI middleware: it leaves ``receive`` alone,
    so handlers still see their client disconnect."""

    def __init__(self, app: ASGIApp, keys: Keys, admin_paths: tuple[str, ...], open_paths: tuple[str, ...]):
        self.app, self.keys, self.admin_paths = app, keys, admin_paths
        # an entry ending in "/" opens everything under it (capability URLs: an unguessable id in the path is the key)
        self.open_paths = tuple(p for p in open_paths if not p.endswith("/"))
        self.open_prefixes = tuple(p for p in open_paths if p.endswith("/"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path not in self.open_paths and not path.startswith(self.open_prefixes):
            admin = scope["path"] in self.admin_paths
            authorization = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            if not self.keys.allows(authorization, admin=admin):
                which = "admin" if admin else "API"
                return await _send_error(send, 401, f"missing or wrong {which} key (Authorization: Bearer ...)")
        return await self.app(scope, receive, send)


def read_keys(env: str, file: str | None) -> tuple[str, ...]:
    """The keys of ``file`` (one per line) or of the environment variable ``env``; none when neither is set."""
    if file:
        keys = tuple(line.strip() for line in Path(file).read_text().splitlines() if line.strip())
        if not keys:
            raise ValueError(f"key file {file} is empty")
        return keys
    key = os.environ.get(env)
    return (key,) if key else ()


def read_key(env: str, file: str | None) -> str | None:
    """A key from ``file`` (first line) or the environment variable ``env``; None when neither is set."""
    keys = read_keys(env, file)
    return keys[0] if keys else None


def caller_of(authorization: str | None) -> str:
    """Who sent a request, as far as the server can tell: a digest of the API key it presented (a server with
    several keys has as many callers; one without a key has one, ""). Client-named sessions live in their
    caller's namespace (serving/sessions.py), so a caller cannot reach another caller's conversation."""
    given = (authorization or "").removeprefix("Bearer ").strip()
    return hashlib.sha256(given.encode()).hexdigest()[:16] if given else ""


@dataclass(frozen=True)
class Keys:
    """``api`` guards generation, ``admin`` guards weights, cache and version routes. ``callers``: more API keys,
    one per caller (the API key file's later lines): each opens its own client-named sessions, with its own
    quota (serving/sessions.py); ``api`` is the one our own clients send."""

    api: str | None = None
    admin: str | None = None
    callers: tuple[str, ...] = ()

    @classmethod
    def load(
        cls, api_key_file: str | None = None, admin_key_file: str | None = None, api_key: str | None = None
    ) -> Keys:
        if api_key:
            return cls(api=api_key, admin=read_key(ADMIN_KEY_ENV, admin_key_file))
        api = read_keys(API_KEY_ENV, api_key_file)
        return cls(api=api[0] if api else None, admin=read_key(ADMIN_KEY_ENV, admin_key_file), callers=api[1:])

    @classmethod
    def load_upstream(cls, api_key_file: str | None = None, admin_key_file: str | None = None) -> Keys:
        """The keys a hop sends to the engines behind it (``--upstream-*-key-file`` or
        ``$SUPPORT_REPLAY_UPSTREAM_*_KEY``). Never its clients' key: on an engine with an API key alone that
        key is also the admin key, so a hop that sent its clients' key on made every client an admin there."""
        return cls(
            api=read_key(UPSTREAM_API_KEY_ENV, api_key_file), admin=read_key(UPSTREAM_ADMIN_KEY_ENV, admin_key_file)
        )

    def needed(self, *, admin: bool) -> str | None:
        """The key a route asks for: admin routes take the admin key, or the API key when only that is set
        (an API key alone must not leave weights and versions open to anyone)."""
        return (self.admin or self.api) if admin else self.api

    def allows(self, authorization: str | None, *, admin: bool) -> bool:
        """Constant-time comparison of ``Authorization: Bearer KEY`` with the key the route needs."""
        needed = self.needed(admin=admin)
        if needed is None:
            return True
        given = (authorization or "").removeprefix("Bearer ").encode()
        accepted = (needed,) if admin else (needed, *self.callers)
        return any([hmac.compare_digest(given, key.encode()) for key in accepted])  # a list: every key compared

    def header(self, *, admin: bool) -> dict:
        key = self.needed(admin=admin)
        return {"Authorization": f"Bearer {key}"} if key else {}


def guarded(
    app: ASGIApp,
    keys: Keys,
    admin_paths,
    open_paths,
    *,
    allowed_hosts: list[str] | None,
    max_request_bytes: int,
    binary_paths: dict[str, int] | None = None,
) -> ASGIApp:
    """An app inside every guard of this module, in the one order the servers use: the body
    limit first (nothing past it is read), then the Host check, the keys, JSON only.
    ``binary_paths``: admin routes taking an octet-stream body, with their own size limit."""
    from starlette.middleware.trustedhost import TrustedHostMiddleware

    binary = dict(binary_paths or {})
    inner = KeyGuard(
        JSONOnly(app, tuple(binary), keyed=keys.needed(admin=True) is not None),
        keys,
        tuple(admin_paths),
        tuple(open_paths),
    )
    return BodyLimit(
        NormalPaths(TrustedHostMiddleware(inner, allowed_hosts=allowed_hosts or ["*"])), max_request_bytes, binary
    )


def exposure_warnings(host: str, keys: Keys, weights_dir) -> list[str]:
    """What a server bound to ``host`` leaves open; raises ``ConfigError`` for what it must not:
    weight loading from disk with no key on an address others can reach."""
    from ..errors import ConfigError

    if host in LOOPBACK_HOSTS:
        return []
    if weights_dir is not None and keys.needed(admin=True) is None:
        raise ConfigError(
            f"--weights-dir on {host} with no key: anyone who reaches the port could load weights; "
            "set --admin-key-file or --api-key-file (or $SUPPORT_REPLAY_ADMIN_KEY), or bind to 127.0.0.1"
        )
    out = []
    if keys.api is None:
        out.append(f"bound to {host} with no API key: anyone who reaches the port can generate (set --api-key-file)")
    if host in ("0.0.0.0", "::"):
        out.append(f"bound to {host}: the Host header is not checked (name the hosts to answer with --allowed-host)")
    return out
