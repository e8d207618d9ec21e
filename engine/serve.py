"""python -m engine.serve: an OpenAI-compatible HTTP server (Open WebUI, the openai client, curl).

    python -m engine.serve --model DIR [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both streamed as SSE
or not), GET /health, GET /metrics (JSON; Prometheus text with ?format=prometheus or an Accept of
text/plain). The engine holds one sequence, so one request generates at a time on a worker
thread; the others wait in a FIFO of --queue-size, and a request that finds it full gets 503 with
Retry-After. A client that goes away stops its generation within one token. docs/SERVE.md says
which OpenAI fields are honoured and how.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import hmac
import json
import sys
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.runtime import GenerationParams
from engine.tokenizer import StreamDecoder, TemplateError
from engine.harmony import uses_harmony
from engine.toolcalls import call_format, param_types, reply_parser, split_reply

RETRY_AFTER_S = 1                   # the Retry-After of a 503 (queue full)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt",
                     "bos_token", "eos_token", "pad_token", "unk_token")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's
# Fields we do not implement, accepted only at their "off" value (anything else is a 400, so a
# client never silently gets something other than what it asked for).
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "frequency_penalty": (None, 0),
               "presence_penalty": (None, 0), "logit_bias": (None, {}), "best_of": (None, 1),
               "echo": (None, False), "suffix": (None, "")}


# ---- errors ---------------------------------------------------------------------------------------

class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _json_type(v) -> str:
    if v is None:
        return "null"
    for t, n in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                 (list, "array"), (dict, "object")):
        if isinstance(v, t):
            return n
    return type(v).__name__


_KINDS = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "boolean": lambda v: isinstance(v, bool), "string": lambda v: isinstance(v, str),
          "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict)}


def _field(body: dict, key: str, kind: str, default=None, param: str | None = None):
    """body[key] checked to be of the JSON kind; absent or null -> default."""
    v = body.get(key)
    if v is None:
        return default
    if not _KINDS[kind](v):
        raise ApiError(400, f"'{param or key}' must be {'an' if kind[0] in 'aeio' else 'a'} {kind}, "
                            f"got {_json_type(v)}", param=param or key)
    return v


# ---- what the server knows about its model --------------------------------------------------------

@dataclass(frozen=True)
class ServedModel:
    name: str               # the id clients send as "model"
    max_context: int        # prompt + completion tokens, the engine's KV length
    vocab_size: int
    # Sampling defaults when the request leaves them out: the model's generation_config.json,
    # else OpenAI's (temperature 1, top_p 1); top_k is an extension (0 = off).
    temperature: float
    top_p: float
    top_k: int
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def from_engine(cls, engine, name: str) -> "ServedModel":
        gen = engine.generation_defaults
        return cls(name, int(engine.max_context), int(engine.config.vocab_size),
                   float(gen.get("temperature", 1.0)), float(gen.get("top_p", 1.0)),
                   int(gen.get("top_k", 0)))


@dataclass(frozen=True)
class GenRequest:
    """One validated request: what to feed the engine and how to answer."""
    kind: str                   # "chat" or "text"
    prompt_ids: list
    params: GenerationParams
    stop: tuple                 # stop strings, matched on the decoded text
    stream: bool
    include_usage: bool
    reply: str = "text"         # chat replies: "text" as it is, "tool_calls" / "minimax" / "kimi" (call blocks
                                # -> message.tool_calls) or "harmony" (gpt-oss's channels;
                                # "harmony-text" where no tool calls are allowed), engine/toolcalls.py
    tool_types: dict = field(default_factory=dict)   # param_types() of the request's tools
    thinking: bool = False      # the prompt ends inside <think>: the reply starts as reasoning

    def parser(self):
        return reply_parser(self.reply, self.tool_types, self.thinking)


def _check_unsupported(body: dict):
    n = _field(body, "n", "integer", 1)
    if n != 1:
        raise ApiError(400, f"'n' must be 1: this server generates one choice per request (got {n})",
                       param="n")
    for key, off in UNSUPPORTED.items():
        if body.get(key) not in off:
            raise ApiError(400, f"'{key}' is not supported by this server (leave it out or set it "
                                f"to {json.dumps(off[-1])})", param=key)
    fmt = _field(body, "response_format", "object")
    if fmt is not None and fmt.get("type", "text") != "text":
        raise ApiError(400, "'response_format' other than {\"type\": \"text\"} is not supported",
                       param="response_format")


def _sampling(body: dict, model: ServedModel, prompt_len: int, default_max: int | None) -> GenerationParams:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _field(body, key, "integer")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"'{key}' must be at least 1, got {max_tokens}", param=key)
    temperature = _field(body, "temperature", "number", model.temperature)
    if not 0 <= temperature <= 2:
        raise ApiError(400, f"'temperature' must be in [0, 2], got {temperature}", param="temperature")
    top_p = _field(body, "top_p", "number", model.top_p)
    if not 0 < top_p <= 1:
        raise ApiError(400, f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = _field(body, "top_k", "integer", model.top_k)
    if top_k < 0:
        raise ApiError(400, f"'top_k' must be >= 0 (0 = off), got {top_k}", param="top_k")
    seed = _field(body, "seed", "integer")
    if seed is not None and seed < 0:
        raise ApiError(400, f"'seed' must be >= 0, got {seed}", param="seed")

    room = model.max_context - prompt_len
    if room < 1:
        raise ApiError(400, f"This model's maximum context length is {model.max_context} tokens, and the "
                            f"prompt has {prompt_len} tokens: no room for a completion. Shorten the prompt.",
                       param="messages" if "messages" in body else "prompt", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    elif prompt_len + max_tokens > model.max_context:
        raise ApiError(400, f"This model's maximum context length is {model.max_context} tokens, but "
                            f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, "
                            f"{max_tokens} in '{key}'). Set '{key}' to at most {room}, or shorten the "
                            "prompt.",
                       param=key, code="context_length_exceeded")
    return GenerationParams(max_new_tokens=max_tokens, temperature=float(temperature), top_k=top_k,
                            top_p=float(top_p), seed=seed)


def _stop_strings(body: dict) -> tuple:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, f"'stop' must be a string or an array of strings, got {_json_type(stop)}",
                       param="stop")
    if any(s == "" for s in stops):
        raise ApiError(400, "'stop' strings must not be empty", param="stop")
    return tuple(stops)


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _field(body, "stream", "boolean", False)
    opts = _field(body, "stream_options", "object", {})
    include_usage = _field(opts, "include_usage", "boolean", False, param="stream_options.include_usage")
    return stream, include_usage


def _message_text(m: dict, i: int) -> str | None:
    """A message's content as one string: text parts are joined with newlines."""
    content = m.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
            if not isinstance(text, str):
                kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are supported "
                                    f"(got {kind!r})", param=f"messages[{i}].content")
            texts.append(text)
        return "\n".join(texts)
    raise ApiError(400, f"'messages[{i}].content' must be a string or an array of text parts, "
                        f"got {_json_type(content)}", param=f"messages[{i}].content")


def parse_chat(body: dict, model: ServedModel, tokenizer) -> GenRequest:
    messages = _field(body, "messages", "array")
    if not messages:
        raise ApiError(400, "'messages' is required: a non-empty array of {role, content} objects",
                       param="messages")
    _check_unsupported(body)
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"'messages[{i}]' must be an object, got {_json_type(m)}",
                           param=f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"'messages[{i}].role' must be one of {', '.join(CHAT_ROLES)}; got {role!r}",
                           param=f"messages[{i}].role")
        text = _message_text(m, i)
        if text is None and role != "assistant":
            raise ApiError(400, f"'messages[{i}].content' is required for role {role!r}",
                           param=f"messages[{i}].content")
        msgs.append({**m, "content": text})
    tools = _field(body, "tools", "array")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ApiError(400, "'tools' must be an array of objects", param="tools")
    choice = body.get("tool_choice")
    choice = "auto" if choice is None else choice
    if not (choice in ("auto", "none", "required") or isinstance(choice, dict)):
        raise ApiError(400, "'tool_choice' must be \"auto\", \"none\", \"required\" or an object "
                            f"naming a function; got {json.dumps(choice)}", param="tool_choice")
    add_generation_prompt = _field(body, "add_generation_prompt", "boolean", True)
    kwargs = _field(body, "chat_template_kwargs", "object", {})
    clash = [k for k in kwargs if k in TEMPLATE_RESERVED]
    if clash:
        raise ApiError(400, f"'chat_template_kwargs' may not set {', '.join(clash)}",
                       param="chat_template_kwargs")
    stop = _stop_strings(body)
    stream, include_usage = _stream_flags(body)
    try:
        text = _render(tokenizer, msgs, add_generation_prompt, tools or None, kwargs)
    except TemplateError as e:
        raise ApiError(400, f"{e} (use /v1/completions for raw text)" if tokenizer.chat_template is None
                       else str(e), param="messages")
    ids = tokenizer.encode(text, add_special_tokens=False)   # the template writes its own BOS
    params = _sampling(body, model, len(ids), None)
    calls = bool(tools) and choice != "none"
    reply = (("harmony" if calls else "harmony-text") if uses_harmony(tokenizer) else
             (calls and call_format(tokenizer.chat_template.source)) or "text")
    return GenRequest("chat", ids, params, stop, stream, include_usage, reply,
                      param_types(tools) if calls else {}, text.rstrip().endswith("<think>"))


def _render(tokenizer, msgs, add_generation_prompt, tools, kwargs) -> str:
    """The chat template on the messages with the history's tool-call arguments as objects
    (the API sends a JSON string; Hugging Face's and vLLM's convention, which Qwen2.5's
    `arguments | tojson` and Qwen3.5's `arguments | items` expect); where that fails, again
    with the strings as the client sent them (DeepSeek's templates concatenate them)."""
    objs = [{**m, "tool_calls": [_call_for_template(c) for c in m["tool_calls"]]}
            if isinstance(m.get("tool_calls"), list) else m for m in msgs]
    try:
        return tokenizer.apply_chat_template(objs, add_generation_prompt, tools, **kwargs)
    except TemplateError:
        if objs == msgs:
            raise
    return tokenizer.apply_chat_template(msgs, add_generation_prompt, tools, **kwargs)


def _call_for_template(call):
    """An assistant message's tool call with its arguments as an object where they are a JSON
    object's text, else unchanged."""
    f = call.get("function") if isinstance(call, dict) else None
    if isinstance(f, dict) and isinstance(f.get("arguments"), str):
        try:
            args = json.loads(f["arguments"])
        except ValueError:
            return call
        if isinstance(args, dict):
            return {**call, "function": {**f, "arguments": args}}
    return call


def parse_completion(body: dict, model: ServedModel, tokenizer) -> GenRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                                  # a batch of one
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(_KINDS["integer"](t) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < model.vocab_size]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary "
                                f"(0..{model.vocab_size - 1})", param="prompt")
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, f"'prompt' holds {len(prompt)} prompts: this server takes one per request",
                       param="prompt")
    else:
        raise ApiError(400, "'prompt' is required: a string or an array of token ids", param="prompt")
    if not ids:
        raise ApiError(400, "'prompt' is empty: give at least one token", param="prompt")
    _check_unsupported(body)
    stop = _stop_strings(body)
    stream, include_usage = _stream_flags(body)
    params = _sampling(body, model, len(ids), DEFAULT_COMPLETION_MAX_TOKENS)
    return GenRequest("text", ids, params, stop, stream, include_usage)


# ---- stop strings ---------------------------------------------------------------------------------

class StopMatcher:
    """Finds stop strings in text that arrives in pieces. Text that could still be the start of a
    stop string is held back until the next piece decides it; the stop string is never returned."""

    def __init__(self, stops: tuple):
        self.stops = stops
        self.held = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """-> (text safe to send now, whether a stop string was hit)."""
        if not self.stops:
            return piece, False
        text = self.held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return text[:min(hits)], True
        keep = 0   # the longest tail of text that is a proper prefix of some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held text, once generation has ended without a stop string."""
        text, self.held = self.held, ""
        return text


# ---- the worker: one generation at a time ---------------------------------------------------------

class Job:
    """One admitted request. The worker thread reports to the event loop through `events`:
    ("start", None), ("text", str), ("end", "stop" | "length"), ("error", message), ("gone", None)."""

    def __init__(self, req: GenRequest, loop: asyncio.AbstractEventLoop):
        self.req, self.loop = req, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()        # set: stop at the next token, or never start
        self.completion_tokens = 0
        self.cached_tokens = 0                 # prompt ids resumed from the last run state

    def emit(self, kind: str, value=None):
        """From the worker thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:                   # the event loop has closed: nobody is listening
            self.cancel.set()


@dataclass
class Metrics:
    requests_total: int = 0         # admitted
    requests_completed_total: int = 0
    requests_cancelled_total: int = 0   # the client went away
    requests_rejected_total: int = 0    # 503, queue full
    requests_failed_total: int = 0
    prompt_tokens_total: int = 0
    prompt_cached_tokens_total: int = 0   # of those, resumed from an earlier run state
    prompt_cached_from_saved_total: int = 0   # requests resumed from a saved copy (engine/prefix.py)
    prefix_saved_states: int = 0        # copies of run states kept for resuming, and their bytes
    prefix_saved_bytes: int = 0
    completion_tokens_total: int = 0
    last_prompt_tokens: int = 0
    last_completion_tokens: int = 0
    last_prefill_tok_s: float = 0.0
    last_decode_tok_s: float = 0.0
    last_wall_s: float = 0.0
    last_finish_reason: str = ""
    experts: dict = field(default_factory=dict)   # the engine's expert stats after the last request
    vram: dict = field(default_factory=dict)      # its VRAM residency stats (device cuda), else {}


class Worker:
    """Runs jobs one at a time on its own thread, in arrival order. At most 1 + queue_size jobs
    are in the system (one generating, the rest waiting); submit refuses the next with a 503."""

    def __init__(self, engine, queue_size: int):
        self.engine, self.queue_size = engine, queue_size
        self.pending: collections.deque[Job] = collections.deque()
        self.running: Job | None = None
        self.metrics = Metrics()
        self.cond = threading.Condition()
        self.closed = False
        self.thread: threading.Thread | None = None

    def submit(self, job: Job):
        with self.cond:
            if len(self.pending) + (self.running is not None) >= 1 + self.queue_size:
                self.metrics.requests_rejected_total += 1
                raise ApiError(503, f"the server is busy: one request is generating and {len(self.pending)} "
                                    f"are waiting (--queue-size {self.queue_size}); retry later",
                               code="queue_full")
            self.metrics.requests_total += 1
            self.pending.append(job)
            self.cond.notify()
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="moe-stream-worker", daemon=True)
                self.thread.start()

    def cancel(self, job: Job):
        """The client is gone: drop the job if it waits; if it runs, it stops at its next token."""
        job.cancel.set()
        with self.cond:
            if job in self.pending:
                self.pending.remove(job)
                self.metrics.requests_cancelled_total += 1

    def close(self):
        with self.cond:
            self.closed = True
            for job in (*self.pending, self.running):
                if job is not None:
                    job.cancel.set()
                    job.emit("error", "the server is shutting down")
            self.pending.clear()
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=10)

    def snapshot(self) -> dict:
        with self.cond:
            d = {k: v for k, v in vars(self.metrics).items() if k not in ("experts", "vram")}
            d.update(queue_depth=len(self.pending), running=int(self.running is not None),
                     queue_size=self.queue_size, experts=dict(self.metrics.experts),
                     vram=dict(self.metrics.vram))
        return d

    def _loop(self):
        while True:
            with self.cond:
                while not self.pending and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                job = self.running = self.pending.popleft()
            try:
                self._run(job)
            except Exception as e:  # an engine failure ends this request, not the server
                job.emit("error", f"generation failed: {type(e).__name__}: {e}")
            finally:
                with self.cond:
                    self.running = None

    def _run(self, job: Job):
        eng, req = self.engine, job.req
        if job.cancel.is_set():             # the client left between the queue and here
            with self.cond:
                self.metrics.requests_cancelled_total += 1
            return
        stats: dict = {}
        # harmony's channel markers are special tokens: kept for the reply's parser
        dec, stop = (StreamDecoder(eng.tokenizer, not req.reply.startswith("harmony")),
                     StopMatcher(req.stop))
        outcome = "cancelled"               # unless the loop ends by itself: "stop" or "length"
        t0 = time.perf_counter()
        job.emit("start")
        gen = eng.stream(req.prompt_ids, req.params, stats)
        try:
            for tid in gen:
                job.completion_tokens += 1
                text, hit = stop.push(dec.push(tid))
                if text:
                    job.emit("text", text)
                if hit:
                    outcome = "stop"
                    break
                if job.cancel.is_set():
                    break
            else:
                text, hit = stop.push(dec.flush())
                text += "" if hit else stop.flush()
                if text:
                    job.emit("text", text)
                outcome = "stop" if hit else stats["finish_reason"]
        except Exception:
            outcome = "failed"
            raise
        finally:
            gen.close()                     # ends the engine's loop
            if not eng.prefix_cache:        # else kept: the chat's next turn resumes from it
                eng.release_state()         # frees the KV cache
            self._account(job, stats, outcome, time.perf_counter() - t0)
        job.emit("gone" if outcome == "cancelled" else "end", outcome)

    def _account(self, job: Job, stats: dict, outcome: str, wall_s: float):
        m, n = self.metrics, job.completion_tokens
        experts = stats["experts"] if "experts" in stats else self.engine.experts.stats()
        with self.cond:
            if outcome == "cancelled":
                m.requests_cancelled_total += 1
            elif outcome == "failed":
                m.requests_failed_total += 1
            else:
                m.requests_completed_total += 1
            m.prompt_tokens_total += len(job.req.prompt_ids)
            job.cached_tokens = int(stats.get("prefill_cached_tokens", 0))
            m.prompt_cached_tokens_total += job.cached_tokens
            m.prompt_cached_from_saved_total += stats.get("prefill_cached_from") == "saved"
            saved = self.engine.saved
            m.prefix_saved_states, m.prefix_saved_bytes = len(saved.items), saved.nbytes
            m.completion_tokens_total += n
            m.last_prompt_tokens, m.last_completion_tokens = len(job.req.prompt_ids), n
            m.last_prefill_tok_s = float(stats.get("prefill_tok_s", 0.0))
            m.last_decode_tok_s = stats.get("decode_tokens", 0) / max(stats.get("decode_s", 0.0), 1e-9)
            m.last_wall_s, m.last_finish_reason = wall_s, outcome
            m.experts = experts
            m.vram = stats["vram"] if "vram" in stats else {}


# ---- HTTP -----------------------------------------------------------------------------------------

def _usage(job: Job) -> dict:
    p, c = len(job.req.prompt_ids), job.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": job.cached_tokens}}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Server:
    def __init__(self, engine, model_name: str, api_key: str | None, queue_size: int):
        self.engine = engine
        self.model = ServedModel.from_engine(engine, model_name)
        self.api_key = api_key
        self.worker = Worker(engine, queue_size)

    # -- plumbing

    def check_auth(self, request: Request):
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())
        if not ok:
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def read_body(self, request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {_json_type(body)}")
        name = body.get("model")
        if not isinstance(name, str):
            raise ApiError(400, f"'model' is required: a string (this server has {self.model.name!r})",
                           param="model")
        if name != self.model.name:
            raise ApiError(404, f"The model '{name}' does not exist; this server has '{self.model.name}'",
                           param="model", code="model_not_found")
        return body

    async def watch_disconnect(self, request: Request, job: Job):
        """Cancel the job once the client is gone (waiting in the queue or generating)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.worker.cancel(job)
                job.events.put_nowait(("gone", None))
                return

    async def run(self, request: Request, req: GenRequest):
        job = Job(req, asyncio.get_running_loop())
        self.worker.submit(job)
        # watched from here on, even if the response body never starts
        watcher = asyncio.create_task(self.watch_disconnect(request, job))
        if req.stream:
            return StreamingResponse(self.stream_events(job, watcher), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        pieces = []
        try:
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    pieces.append(value)
                elif kind == "end":
                    return JSONResponse(self.whole(job, "".join(pieces), value))
                elif kind == "error":
                    raise ApiError(500, value)
                elif kind == "gone":
                    return Response(status_code=499)   # nobody is left to read it
        finally:
            watcher.cancel()
            self.worker.cancel(job)

    # -- response bodies

    def whole(self, job: Job, text: str, finish: str) -> dict:
        rid, chat = uuid.uuid4().hex, job.req.kind == "chat"
        message = {"role": "assistant", "content": text}
        if chat and job.req.reply != "text":
            content, reasoning, calls = split_reply(text, job.req.reply, job.req.tool_types,
                                                    job.req.thinking)
            message = {"role": "assistant", "content": content}
            if reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        choice = ({"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
                  if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        return {"id": ("chatcmpl-" if chat else "cmpl-") + rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model.name, "system_fingerprint": None,
                "choices": [choice], "usage": _usage(job)}

    async def stream_events(self, job: Job, watcher: asyncio.Task):
        req, chat = job.req, job.req.kind == "chat"
        base = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model.name, "system_fingerprint": None}

        def chunk(delta: dict | str, finish=None) -> str:
            choice = ({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish} if chat else
                      {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish})
            extra = {"usage": None} if req.include_usage else {}
            return _sse({**base, "choices": [choice], **extra})

        parser = req.parser() if chat and req.reply != "text" else None
        calls = 0

        def pieces(events):   # parser events -> chunks; tool calls numbered in order
            nonlocal calls
            for k, v in events:
                if k == "call":
                    calls += 1
                    yield chunk({"tool_calls": [{"index": calls - 1, **v}]})
                else:
                    yield chunk({"content" if k == "text" else "reasoning_content": v})

        try:
            while True:
                kind, value = await job.events.get()
                if kind == "start" and chat:
                    yield chunk({"role": "assistant", "content": ""})
                elif kind == "text" and parser is not None:
                    for c in pieces(parser.push(value)):
                        yield c
                elif kind == "text":
                    yield chunk({"content": value} if chat else value)
                elif kind == "end":
                    if parser is not None:
                        for c in pieces(parser.flush()):
                            yield c
                        value = "tool_calls" if calls and value == "stop" else value
                    yield chunk({} if chat else "", finish=value)
                    if req.include_usage:
                        yield _sse({**base, "choices": [], "usage": _usage(job)})
                    yield "data: [DONE]\n\n"
                    return
                elif kind == "error":
                    yield _sse(ApiError(500, value).body())
                    yield "data: [DONE]\n\n"
                    return
                elif kind == "gone":
                    return
        finally:   # normal end, client gone (starlette cancels us), or server shutdown
            watcher.cancel()
            self.worker.cancel(job)

    # -- endpoints

    async def models(self, request: Request):
        self.check_auth(request)
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model_info(self, request: Request):
        self.check_auth(request)
        name = request.path_params["name"]
        if name != self.model.name:
            raise ApiError(404, f"The model '{name}' does not exist; this server has '{self.model.name}'",
                           param="model", code="model_not_found")
        return JSONResponse(self.model_card())

    def model_card(self) -> dict:
        return {"id": self.model.name, "object": "model", "created": self.model.created,
                "owned_by": "moe-stream", "max_model_len": self.model.max_context}

    async def chat_completions(self, request: Request):
        self.check_auth(request)
        body = await self.read_body(request)
        return await self.run(request, parse_chat(body, self.model, self.engine.tokenizer))

    async def completions(self, request: Request):
        self.check_auth(request)
        body = await self.read_body(request)
        return await self.run(request, parse_completion(body, self.model, self.engine.tokenizer))

    async def health(self, request: Request):
        return JSONResponse({"status": "ok", "model": self.model.name})

    async def metrics(self, request: Request):
        snap = {"model": self.model.name, "max_context": self.model.max_context, **self.worker.snapshot()}
        accept = request.headers.get("accept", "")
        if request.query_params.get("format") == "prometheus" or (
                ("text/plain" in accept or "openmetrics" in accept) and "application/json" not in accept):
            return PlainTextResponse(prometheus_text(snap), media_type="text/plain; version=0.0.4")
        return JSONResponse(snap)


def prometheus_text(snap: dict) -> str:
    """Numeric metrics as Prometheus text: moe_stream_<name>; the engine's cache stats as
    moe_stream_experts_<name> and moe_stream_vram_<name>."""
    flat = [(k, v) for k, v in snap.items() if k not in ("experts", "vram")]
    for group in ("experts", "vram"):
        flat += [(f"{group}_" + k.removeprefix(f"{group}_"), v) for k, v in snap[group].items()]
    lines = []
    for k, v in flat:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        name = f"moe_stream_{k}"
        lines.append(f"# TYPE {name} {'counter' if k.endswith('_total') else 'gauge'}")
        lines.append(f"{name} {v}")
    return "\n".join(lines) + "\n"


def create_app(engine, model_name: str, api_key: str | None = None, queue_size: int = 8) -> Starlette:
    """The ASGI app over one loaded engine. queue_size: requests that may wait behind the one
    generating before the next gets a 503."""
    if queue_size < 0:
        raise ValueError(f"queue_size must be >= 0, got {queue_size}")
    srv = Server(engine, model_name, api_key, queue_size)

    @asynccontextmanager
    async def lifespan(app):
        yield
        srv.worker.close()

    async def api_error(request, exc: ApiError):
        return exc.response()

    async def http_error(request, exc: HTTPException):
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()

    async def server_error(request, exc: Exception):
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    routes = [Route("/v1/models", srv.models, methods=["GET"]),
              Route("/v1/models/{name:path}", srv.model_info, methods=["GET"]),
              Route("/v1/chat/completions", srv.chat_completions, methods=["POST"]),
              Route("/v1/completions", srv.completions, methods=["POST"]),
              Route("/health", srv.health, methods=["GET"]),
              Route("/metrics", srv.metrics, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: api_error, HTTPException: http_error,
                                        Exception: server_error})
    app.state.server = srv
    return app


# ---- CLI ------------------------------------------------------------------------------------------

def parse_args(argv=None):
    from engine.cli import add_load_args, add_prefix_args, check_prefix_args
    p = argparse.ArgumentParser(prog="python -m engine.serve", description=__doc__.splitlines()[0])
    add_load_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--queue-size", type=int, default=8,
                   help="requests that may wait behind the one generating; more get 503 (default 8)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the model folder's name)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole and free the KV cache between requests "
                        "(default: keep the last request's run state; a prompt that begins with "
                        "its ids, a chat's next turn, prefills only the rest)")
    add_prefix_args(p)
    a = p.parse_args(argv)
    check_prefix_args(p, a)
    if not 0 <= a.port <= 65535:
        p.error("--port must be in 0..65535")
    if a.queue_size < 0:
        p.error("--queue-size must be >= 0")
    if a.max_context is not None and a.max_context < 2:
        p.error("--max-context must be at least 2")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    import uvicorn

    from engine.models.rope import ConfigError
    from loader.checkpoint import CheckpointError
    try:
        from engine.cli import load_from_args, model_dir
        d = model_dir(a)
        name = Path(d).name if a.model is None or Path(a.model).is_dir() else a.model
        m = load_from_args(a)
        m.generate([0], max_new_tokens=2)   # compile the kernels now, not in the first request
        m.release_state()
        m.prefix_cache = not a.no_prefix_cache
    except (CheckpointError, ConfigError, TemplateError, ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = a.served_model_name or name
    app = create_app(m, name, api_key=a.api_key, queue_size=a.queue_size)
    if a.host not in ("127.0.0.1", "localhost", "::1") and a.api_key is None:
        print(f"warning: listening on {a.host} without --api-key: anyone who can reach this port can use it",
              file=sys.stderr)
    print(f"serving {name!r} (context {m.max_context}, device {m.device}) at http://{a.host}:{a.port}/v1",
          file=sys.stderr)
    print(m.cores.describe(), file=sys.stderr)
    uvicorn.run(app, host=a.host, port=a.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
