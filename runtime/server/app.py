"""The OpenAI-compatible HTTP server (FastAPI): routes, auth, errors, SSE framing.

    POST /v1/completions, /v1/chat/completions   streaming (SSE) or not
    GET  /v1/models, /v1/models/{id}
    GET  /health                                 200, or 503 naming why the engine is unusable
    GET  /metrics                                Prometheus text format

With an API key, /v1/* needs `Authorization: Bearer KEY` (401 otherwise); /health and /metrics
stay open for probes and scrapers. Every error is {"error": {message, type, param, code}} with a
4xx for the client's mistakes and 5xx for ours; one bad request never affects another.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3compile.runtime.sampling import SamplingParams

from . import protocol as P
from .async_engine import AsyncEngine, EngineError
from .metrics import ServerMetrics
from .serving import Generation, start_generation

log = logging.getLogger("k3compile.server")

_COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; chat runs to the context


def build_app(front: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app owns the front's lifetime: the engine thread starts and stops with the server."""
    if front.tokenizer is None:
        raise ValueError("the model has no tokenizer (no tokenizer files and no byte-level vocabulary); "
                         "the server needs one to turn text into tokens")
    metrics = ServerMetrics(front)
    created = P.now()

    @asynccontextmanager
    async def lifespan(app):
        front.start()
        yield
        front.shutdown()

    app = FastAPI(title="k3compile", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front, app.state.metrics = front, metrics
    from .profiling import register as register_profiling   # POST /start_profile, /stop_profile
    app.state.profiler = register_profiling(app, front)

    # -- errors ---------------------------------------------------------------------------------

    @app.exception_handler(P.ApiError)
    async def api_error(request: Request, e: P.ApiError):
        metrics.errors.labels(status=str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        metrics.errors.labels(status=str(e.status_code)).inc()
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(P.ApiError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        log.exception("unhandled error serving %s", request.url.path)
        metrics.errors.labels(status="500").inc()
        return JSONResponse(P.ApiError(500, f"internal server error: {e!r}", "server_error").body(), status_code=500)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise P.ApiError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key")

    # -- info -----------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        problem = front.health()
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "error": problem}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "k3compile",
                "max_model_len": front.max_context}

    @app.get("/v1/models", dependencies=[Depends(check_auth)])
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(check_auth)])
    async def model(model_id: str):
        check_model(model_id, "model")
        return model_card()

    def check_model(name: str, param: str = "model") -> None:
        if name != model_name:
            raise P.ApiError(404, f"the model '{name}' does not exist; this server serves '{model_name}'",
                             param=param, code="model_not_found")

    # -- generation -----------------------------------------------------------------------------

    @app.post("/v1/completions", dependencies=[Depends(check_auth)])
    async def completions(request: Request):
        req = P.parse_completion(await json_body(request))
        check_model(req.model)
        tok = front.tokenizer
        prompt_ids = tok.encode(req.prompt) if isinstance(req.prompt, str) else req.prompt
        return await serve(request, req, prompt_ids, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)])
    async def chat_completions(request: Request):
        req = P.parse_chat(await json_body(request))
        check_model(req.model)
        return await serve(request, req, front.tokenizer.apply_chat_template(req.messages), chat=True)

    async def serve(request: Request, req: P.GenerationRequest, prompt_ids: list[int], chat: bool):
        params = sampling_params(req, len(prompt_ids), default_max=None if chat else _COMPLETION_DEFAULT_MAX_TOKENS)
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        try:
            gen = await start_generation(front, rid, prompt_ids, params, req.stop)
        except ValueError as e:   # the engine's own check (out-of-vocabulary ids, ...)
            raise P.ApiError(400, str(e), param="messages" if chat else "prompt") from None
        except EngineError as e:
            raise P.ApiError(503, str(e), "server_error", code="engine_unavailable") from None
        stamp = P.now()
        if req.stream:
            return StreamingResponse(sse_events(gen, req, rid, stamp, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await whole_response(request, gen, req, rid, stamp, chat)

    def sampling_params(req: P.GenerationRequest, prompt_len: int, default_max: int | None) -> SamplingParams:
        room = front.max_context - prompt_len
        if room < 1:
            raise P.ApiError(400, f"the prompt has {prompt_len} tokens; this model's maximum context length is "
                             f"{front.max_context} tokens, and at least one must be left to generate",
                             param="messages" if isinstance(req, P.ChatRequest) else "prompt",
                             code="context_length_exceeded")
        if req.max_tokens is not None and req.max_tokens > room:
            raise P.ApiError(400, f"this model's maximum context length is {front.max_context} tokens; the prompt "
                             f"has {prompt_len} and max_tokens asks for {req.max_tokens} more",
                             param="max_tokens", code="context_length_exceeded")
        max_tokens = req.max_tokens if req.max_tokens is not None else min(default_max or room, room)
        # the engine stops at the tokenizer's eos itself unless ignore_eos
        return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              max_new_tokens=max_tokens, seed=req.seed, ignore_eos=req.ignore_eos)

    async def whole_response(request: Request, gen: Generation, req, rid: str, stamp: int, chat: bool):
        async def collect():
            parts, ids, last = [], [], None
            try:
                async for d in gen.deltas():
                    parts.append(d.text)
                    ids.extend(d.token_ids)
                    last = d
            finally:
                gen.stream.abort()
            return "".join(parts), ids, last

        # a client that hangs up stops its generation, as a stream's does
        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()   # its finally aborts the engine request
        if not work.done() or work.cancelled():
            return Response(status_code=499)   # nobody is listening
        try:
            text, ids, last = work.result()
        except EngineError as e:
            raise P.ApiError(500, str(e), "server_error", code="engine_error") from None
        metrics.requests.labels(finish_reason=str(last.finish_reason)).inc()
        token_ids = ids if req.return_token_ids else None
        choice = P.chat_choice(text, last.finish_reason, token_ids) if chat else \
            P.completion_choice(text, last.finish_reason, token_ids)
        return P.envelope(rid, "chat.completion" if chat else "text_completion", stamp, req.model, [choice],
                          P.usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens))

    async def sse_events(gen: Generation, req, rid: str, stamp: int, chat: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"
        usage_key = req.include_usage   # with include_usage every chunk carries "usage": null

        def event(choices: list[dict], usage_: dict | None = None) -> str:
            return sse(P.envelope(rid, obj, stamp, req.model, choices, usage_, with_usage_key=usage_key))

        def choice(text: str, finish: str | None, ids: list[int], first: bool = False) -> dict:
            token_ids = ids if req.return_token_ids else None
            if not chat:
                return P.completion_choice(text, finish, token_ids)
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return P.chat_delta_choice(delta, finish, token_ids)

        if chat:
            yield event([choice("", None, [], first=True)])
        last = None
        try:
            async for d in gen.deltas():
                last = d
                if d.text or d.finish_reason is not None or (req.return_token_ids and d.token_ids):
                    yield event([choice(d.text, d.finish_reason, d.token_ids)])
        except EngineError as e:   # the status line is sent already: the error goes in the stream
            metrics.errors.labels(status="500").inc()
            yield sse(P.ApiError(500, str(e), "server_error", code="engine_error").body())
            yield "data: [DONE]\n\n"
            return
        finally:
            gen.stream.abort()   # client gone (cancelled or closed mid-stream): free the request now
        metrics.requests.labels(finish_reason=str(last.finish_reason)).inc()
        if req.include_usage:
            yield event([], P.usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens))
        yield "data: [DONE]\n\n"

    return app


async def json_body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise P.ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
