"""What every request passes before a route sees it (pure ASGI, in this order):

    Host       on a loopback bind only the loopback names (and ``--allow-host``) are served: a web
               page whose name rebinds to 127.0.0.1 sends its own name and gets 403 (DNS rebinding)
    API key    with ``--api-key``: ``Authorization: Bearer <key>`` or 401; ``/health`` is open,
               ``/metrics`` too with ``--metrics-public``
    JSON only  a POST body must be ``Content-Type: application/json`` (415 otherwise), so a web page
               cannot send one without a CORS preflight, which this server never grants
    size       a POST body larger than ``--max-body`` is refused (413) from its Content-Length, or as
               soon as the bytes read pass it; nothing is parsed or tokenized before

Refusals are OpenAI-style error JSON, like every other error of the server. The body of an accepted
POST is read here (bounded) and replayed to the route; later ``receive()`` calls go to the client,
so disconnects are still seen.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

from .protocol import ApiError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
PUBLIC_PATHS = ("/health",)


def is_loopback(host: str) -> bool:
    """A bind address that only this machine can reach."""
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind: str, extra=()) -> list[str] | None:
    """The Host names a server bound to ``bind`` answers: on a loopback bind the loopback names, the
    bind address itself (e.g. 127.0.0.2) and ``extra`` (--allow-host); elsewhere ``extra`` only, or
    any name (None) without it."""
    if is_loopback(bind):
        return [*LOOPBACK_NAMES, bind.strip("[]"), *extra]
    return list(extra) or None


def host_name(header: str) -> str:
    """The name of a Host header without its port: 'a.b:80' -> 'a.b', '[::1]:80' -> '::1'."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class Guard:
    """ASGI middleware: ``Guard(app, api_key=..., allowed_hosts=..., max_body=..., ...)``.
    ``allowed_hosts``: the Host names served (None: any); ``on_refused(path, status)``: called for
    each refusal (metrics)."""

    def __init__(self, app, *, api_key: str | None = None, allowed_hosts=None, max_body: int = 2 << 20,
                 metrics_public: bool = False, on_refused=None):
        self.app, self.max_body = app, max_body
        self._key = api_key.encode() if api_key else None
        self.allowed = None if allowed_hosts is None else {host_name(h) for h in allowed_hosts}
        self.public = PUBLIC_PATHS + (("/metrics",) if metrics_public else ())
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope.get("path", "")
        try:
            self._check_host(headers)
            self._check_key(headers, path)
            if scope["method"] == "POST":
                receive = await self._read_body(headers, receive)
                if receive is None:  # the client left while sending: nobody to answer
                    return None
        except ApiError as e:
            if self.on_refused is not None:
                self.on_refused(path, e.status)
            return await _respond(send, e)
        return await self.app(scope, receive, send)

    def _check_host(self, headers: dict) -> None:
        if self.allowed is None:
            return
        name = host_name(headers.get("host", ""))
        if name not in self.allowed:
            raise ApiError(403, f"Host {headers.get('host', '')!r} is not served here; a loopback server answers "
                           f"only {', '.join(sorted(self.allowed))} (ragkv serve --allow-host NAME adds one)",
                           code="host_not_allowed", type_="permission_error")

    def _check_key(self, headers: dict, path: str) -> None:
        if self._key is None or path in self.public:
            return
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self._key):
            what = "no API key given" if not given else "the API key is not valid"
            raise ApiError(401, f"{what}: send the server's key (--api-key / RAGKV_API_KEY) as "
                           "'Authorization: Bearer <key>'", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def _read_body(self, headers: dict, receive):
        ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            raise ApiError(415, f"the request body must be JSON (Content-Type: application/json), got "
                           f"{headers.get('content-type', 'no Content-Type')!r}", code="unsupported_media_type")
        length = headers.get("content-length")
        if length is not None and not length.strip().isdigit():
            raise ApiError(400, f"Content-Length {length!r} is not a byte count")
        if length is not None and int(length) > self.max_body:
            raise self._too_large(length)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise self._too_large(None)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

    def _too_large(self, length: str | None) -> ApiError:
        got = f"Content-Length {length}" if length is not None else "more than that"
        return ApiError(413, f"the request body is too large: at most {self.max_body} bytes (--max-body), got {got}",
                        code="request_too_large")


async def _respond(send, e: ApiError) -> None:
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), *((k.lower().encode(), v.encode()) for k, v in e.headers.items())]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
