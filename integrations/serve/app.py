"""The FastAPI app of ``ragkv serve``: OpenAI chat completions answered from cached chunks.

    POST /v1/chat/completions   OpenAI request/response (+ ``documents``), ``stream: true`` as SSE
    GET  /v1/models             the one served model
    GET  /health                liveness + queue depth
    GET  /metrics               Prometheus text (ragkv.integrations.serve.metrics)

Model work never runs on the event loop: each request is a prefill step then one step per token on
the worker thread (ragkv.integrations.serve.worker). Between steps the request checks its client: a
client that went away stops its generation (counted in ``ragkv_requests_cancelled_total``).
Every request first passes the guard (ragkv.integrations.serve.guard: Host allow-list, API key, JSON
only, body size). Errors are OpenAI-style JSON (``{"error": {message, type, param, code}}``); an
unexpected one is a 500 whose body says only that, the traceback goes to the server log. Every
admitted request gives its place back on every way out (``worker.Slot``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ragkv.store.errors import StoreError

from .chat import Generation
from .guard import Guard
from .metrics import Metrics
from .protocol import ApiError, chunk, completion, new_id, parse_request, sse, usage
from .store import ServeStore
from .worker import Slot, Worker

log = logging.getLogger("ragkv.serve")
DEFAULT_MAX_BODY = 2 << 20  # bytes (--max-body 2M): far more than any model window's worth of text


def error_response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _Stream(StreamingResponse):
    """A streaming response that calls ``on_close`` when the ASGI call ends, however it ends (also
    when the body generator never started, e.g. the client left before the first byte)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def create_app(engine, model_id: str, *, max_queue: int = 32, default_max_tokens: int = 256,
               close_store: bool = True, api_key: str | None = None, metrics_public: bool = False,
               allowed_hosts=None, max_body: int = DEFAULT_MAX_BODY) -> FastAPI:
    """The app serving ``engine`` (a BlendEngine) as ``model_id``, at the engine's recompute ratio and
    selector (its config). On shutdown the queued steps are dropped, the running
    one finishes, and the engine's store is closed (``close_store``). ``api_key``, ``metrics_public``,
    ``allowed_hosts`` (None: any Host) and ``max_body`` (bytes): what every request passes first
    (ragkv.integrations.serve.guard). When the engine's store is a ``ServeStore``
    (ragkv.integrations.serve.store), its write policy's counters are in /metrics."""
    chat = _Chat(engine, model_id, Worker(max_queue), Metrics(), default_max_tokens)

    @asynccontextmanager
    async def lifespan(app):
        log.info("serving %s on store %s (ratio %s)", model_id, engine.store.uri, engine.config.ratio)
        yield
        chat.worker.close()
        if close_store:
            engine.store.close()
            log.info("store %s closed", engine.store.uri)

    app = FastAPI(title="ragkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics = chat.worker, chat.metrics

    def refused(path: str, status: int) -> None:
        if path == "/v1/chat/completions":
            chat.metrics.answered(status)

    app.add_middleware(Guard, api_key=api_key, allowed_hosts=allowed_hosts, max_body=max_body,
                       metrics_public=metrics_public, on_refused=refused)
    _error_handlers(app, chat.metrics)
    writes = engine.store.policy if isinstance(engine.store, ServeStore) else None
    _info_routes(app, model_id, chat.worker, chat.metrics, writes)
    app.post("/v1/chat/completions")(chat.completions)
    return app


def _error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error answered in OpenAI's shape; an unexpected one a 500 that says only that."""

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return error_response(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                       code=kind if e.status_code == 404 else None, type_=kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        return error_response(ApiError(422, f"invalid request: {e.errors()}"))

    @app.exception_handler(Exception)
    async def _server_error(request, e: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        metrics.answered(500)
        return error_response(ApiError(500, "internal server error (see the server log)", type_="server_error"))


def _info_routes(app: FastAPI, model_id: str, worker: Worker, metrics: Metrics, writes) -> None:
    """/health, /metrics, /v1/models."""

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, "queue_depth": worker.admitted, "queue_limit": worker.max_queue}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(worker.admitted, worker.max_queue, writes),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    model_card = {"id": model_id, "object": "model", "created": int(time.time()), "owned_by": "ragkv"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_id:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {model_id!r}",
                           "model", "model_not_found")
        return model_card


class _Chat:
    """POST /v1/chat/completions: admit, prefill and decode on the worker thread, answer or stream."""

    def __init__(self, engine, model_id: str, worker: Worker, metrics: Metrics, default_max_tokens: int):
        self.engine, self.model_id, self.worker, self.metrics = engine, model_id, worker, metrics
        self.default_max_tokens = default_max_tokens

    async def completions(self, request: Request):
        t0 = time.perf_counter()
        try:
            req = parse_request(await request.body(), self.model_id)
            slot = self.worker.admit()
        except ApiError as e:
            self.metrics.answered(e.status)
            if e.status == 429:
                self.metrics.add("requests_rejected")
            return error_response(e)
        # from here every way out gives the place back: an answer, an ApiError, any other exception
        # (a 500 from the handler), a cancelled task, a stream that never started (_Stream)
        gen, streaming = None, False
        try:
            gen = Generation(self.engine, req, self.default_max_tokens)
            try:
                await self.worker.run(gen.prefill, t0)
            except StoreError as e:  # messages name the store with its secrets masked
                raise ApiError(503, f"the K/V store is unavailable: {e}", code="store_unavailable",
                               type_="server_error") from None
            self._account_prefill(gen)
            if req.stream:
                response = _Stream(self._events(gen, slot, t0), on_close=lambda: self._finish(slot, gen, t0, None),
                                   media_type="text/event-stream",
                                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                streaming = True
                return response
            return await self._answer(request, gen, slot, t0)
        except ApiError as e:
            self._finish(slot, gen, t0, e.status)
            return error_response(e)
        finally:
            if not streaming:
                self._finish(slot, gen, t0, None)  # (a no-op when already finished)

    async def _answer(self, request: Request, gen: Generation, slot: Slot, t0: float):
        while not gen.done:
            if await request.is_disconnected():
                self.metrics.add("requests_cancelled")
                return JSONResponse({}, status_code=499)  # nobody reads it
            await self.worker.run(gen.step)
        body = completion(new_id(), self.model_id, gen.take_delta(), gen.finish, self._usage(gen), gen.stats_dict())
        self._finish(slot, gen, t0, 200)
        return JSONResponse(body)

    async def _events(self, gen: Generation, slot: Slot, t0: float):
        rid, status, model_id = new_id(), None, self.model_id
        try:
            yield chunk(rid, model_id, {"role": "assistant", "content": ""})
            while True:
                delta = gen.take_delta()
                if delta:
                    yield chunk(rid, model_id, {"content": delta})
                if gen.done:
                    break
                await self.worker.run(gen.step)
            yield chunk(rid, model_id, {}, gen.finish, ragkv=gen.stats_dict())
            if gen.req.include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                           "model": model_id, "choices": [], "usage": self._usage(gen)})
            yield sse("[DONE]")
            status = 200
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.add("requests_cancelled")
            raise
        except Exception:
            log.exception("stream %s failed", rid)
            status = 500
            yield sse(ApiError(500, "internal server error (see the server log)", type_="server_error").body())
        finally:
            self._finish(slot, gen, t0, status)

    @staticmethod
    def _usage(gen: Generation) -> dict:
        return usage(gen.prompt_tokens, len(gen.ids), gen.cached_tokens)

    def _account_prefill(self, gen: Generation) -> None:
        m = self.metrics
        m.observe_ttft(gen.ttft)
        m.add("prompt_tokens", gen.prompt_tokens)
        if gen.stats is not None:
            m.add("chunk_hits", gen.stats.hits)
            m.add("chunk_misses", gen.stats.misses)
            m.add("recomputed_tokens", gen.stats.recomputed_tokens)
            m.add("cached_tokens", gen.stats.cached_tokens)

    def _finish(self, slot: Slot, gen: Generation | None, t0: float, status: int | None) -> None:
        """Every admitted request ends here: its place and its K/V are given back. Only the first
        call per request counts (``Slot.release`` is once-only)."""
        if not slot.release(time.perf_counter() - t0 if status == 200 else None):
            return
        if status is not None:
            self.metrics.answered(status)
        if gen is not None:
            self.metrics.add("completion_tokens", len(gen.ids))
            self.worker.after(gen.close)  # behind a step of this request that may still be running
