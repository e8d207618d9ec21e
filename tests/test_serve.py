"""The OpenAI-compatible server, end to end: uvicorn on a free local port in a thread, the official
openai client for the happy paths, raw httpx for bad input. A tiny random qwen3_moe on the CPU."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

# the test extras (pip install -e ".[test]"); a bare GPU machine may lack them: skip, not error
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import engine
from engine.demo import DEMO_CONFIG, build_random_qwen3_moe
from engine.runtime import Engine
from engine.serve import StopMatcher, create_app, main

NAME = "tiny-moe"
CONFIG = dict(DEMO_CONFIG, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_experts=4, max_position_embeddings=512)      # context 512
CHATML = ("{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
          "<|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HELLO = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
SLOW_S = 0.02   # per token, for the queue and disconnect tests


class SlowEngine(Engine):
    """The engine with a pause per token, so a request is still running when the test acts.
    yielded: the time.monotonic() of every token it handed over."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.yielded: list[float] = []

    def stream(self, prompt_ids, params, stats=None):
        for tid in super().stream(prompt_ids, params, stats):
            time.sleep(SLOW_S)
            self.yielded.append(time.monotonic())
            yield tid


class FailingEngine(Engine):
    """The engine breaking after three tokens."""

    def stream(self, prompt_ids, params, stats=None):
        for i, tid in enumerate(super().stream(prompt_ids, params, stats)):
            if i == 3:
                raise RuntimeError("expert fetch failed")
            yield tid


class ServerThread:
    """uvicorn on 127.0.0.1 at a free port, in a daemon thread."""

    def __init__(self, app):
        self.app = app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict:
        return httpx.get(self.url + "/metrics").json()

    def wait_idle(self, timeout=30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if not m["running"] and not m["queue_depth"]:
                return m
            assert time.monotonic() < deadline, f"server still busy: {m}"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = build_random_qwen3_moe(tmp_path_factory.mktemp("serve") / "m", CONFIG)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def ref(model_dir):
    """A second engine on the same folder: what the server's answers must equal."""
    return engine.load(model_dir, device="cpu")


@pytest.fixture(scope="module")
def srv(model_dir):
    s = ServerThread(create_app(engine.load(model_dir, device="cpu"), NAME))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def slow(model_dir):
    s = ServerThread(create_app(SlowEngine(model_dir, device="cpu"), NAME, queue_size=1))
    yield s
    s.stop()


def chat_ids(ref, messages, tools=None) -> list[int]:
    text = ref.tokenizer.apply_chat_template(messages, True, tools)
    return ref.tokenizer.encode(text, add_special_tokens=False)


def streamed_chat(client, **kw) -> tuple[str, str, list]:
    """(text, finish_reason, chunks) of a streamed chat completion."""
    chunks = list(client.chat.completions.create(model=NAME, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    return text, finish[0], chunks


# ---- happy paths ----------------------------------------------------------------------------------

def test_models_and_health(srv):
    c = srv.client()
    assert [m.id for m in c.models.list().data] == [NAME]
    assert c.models.retrieve(NAME).id == NAME
    assert httpx.get(srv.url + "/health").json() == {"status": "ok", "model": NAME}


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 7)])
def test_chat_equals_engine(srv, ref, temperature, seed):
    want = ref.generate(chat_ids(ref, HELLO), 40, temperature, seed=seed)
    c = srv.client()
    r = c.chat.completions.create(model=NAME, messages=HELLO, max_tokens=40, temperature=temperature,
                                  seed=seed)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (len(want.prompt_ids), len(want.output_ids), len(want.prompt_ids) + len(want.output_ids))
    text, finish, chunks = streamed_chat(c, messages=HELLO, max_completion_tokens=40,
                                         temperature=temperature, seed=seed)
    assert (text, finish) == (want.text, want.finish_reason)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.usage is None for ch in chunks)      # no include_usage: no usage chunk


def test_seed_reproduces(srv):
    c = srv.client()
    run = lambda seed: c.chat.completions.create(model=NAME, messages=HELLO, max_tokens=30,
                                                 temperature=1.0, seed=seed).choices[0].message.content
    assert run(11) == run(11)
    assert len({run(11), run(12), run(13)}) > 1


def test_stream_include_usage(srv, ref):
    want = ref.generate(chat_ids(ref, HELLO), 25)
    _, _, chunks = streamed_chat(srv.client(), messages=HELLO, max_tokens=25, temperature=0,
                                 stream_options={"include_usage": True})
    last = chunks[-1]
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == \
        (len(want.prompt_ids), len(want.output_ids))
    assert all(ch.usage is None for ch in chunks[:-1])


def test_tools_reach_the_template(srv, ref):
    tools = [{"type": "function", "function": {"name": "get_time", "description": "Current time",
                                               "parameters": {"type": "object", "properties": {}}}}]
    r = srv.client().chat.completions.create(model=NAME, messages=HELLO, tools=tools, max_tokens=1,
                                             temperature=0)
    assert r.usage.prompt_tokens == len(chat_ids(ref, HELLO, tools)) > len(chat_ids(ref, HELLO))


def test_text_parts_are_joined(srv, ref):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi."}]}]
    r = srv.client().chat.completions.create(model=NAME, messages=parts, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == len(chat_ids(ref, [{"role": "user", "content": "Say\nhi."}]))


def test_completions(srv, ref):
    c = srv.client()
    want = ref.generate("def f(x):", 20)
    r = c.completions.create(model=NAME, prompt="def f(x):", max_tokens=20, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, want.finish_reason)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_ids), len(want.output_ids))
    chunks = list(c.completions.create(model=NAME, prompt=want.prompt_ids, max_tokens=20, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.output_ids)
    default = c.completions.create(model=NAME, prompt="abc", temperature=0)   # OpenAI's default: 16
    assert default.usage.completion_tokens == 16 and default.choices[0].finish_reason == "length"


def test_stop_strings(srv, ref):
    want = ref.generate(chat_ids(ref, HELLO), 60).text
    # a two-character printable stop string from the middle: it spans a token boundary (bytes)
    at = next(i for i in range(5, len(want) - 1) if want[i:i + 2].isprintable() and want[i:i + 2].isascii())
    stop = want[at:at + 2]
    expect = want[:want.index(stop)]
    c = srv.client()
    r = c.chat.completions.create(model=NAME, messages=HELLO, max_tokens=60, temperature=0,
                                  stop=["never-in-noise", stop])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (expect, "stop")
    assert r.usage.completion_tokens < 60
    text, finish, _ = streamed_chat(c, messages=HELLO, max_tokens=60, temperature=0, stop=stop)
    assert (text, finish) == (expect, "stop")


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(("END", "xy"))
    assert m.push("abcE") == ("abc", False)     # "E" could start "END"
    assert m.push("N") == ("", False)
    assert m.push("Dzz") == ("", True)          # "END" found: text before it was already sent
    m = StopMatcher(("END",))
    assert m.push("aEN") == ("a", False)
    assert m.push("x") == ("ENx", False)        # not a stop after all: released
    assert m.push("E") == ("", False)
    assert m.flush() == "E"                     # generation ended: the held text goes out
    assert StopMatcher(()).push("END") == ("END", False)


# ---- concurrency and disconnects -------------------------------------------------------------------

def test_two_clients_served_in_order(slow, ref):
    got = {"a": [], "b": []}           # (arrival time, content) per chunk

    def run(tag, max_tokens):
        for chunk in slow.client().chat.completions.create(model=NAME, messages=HELLO, max_tokens=max_tokens,
                                                           temperature=0, stream=True):
            if chunk.choices:
                got[tag].append((time.monotonic(), chunk.choices[0].delta.content))

    a = threading.Thread(target=run, args=("a", 40))       # 0.8 s at 20 ms a token
    a.start()
    deadline = time.monotonic() + 30
    while not got["a"]:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    b = threading.Thread(target=run, args=("b", 20))
    b.start()
    while slow.metrics()["queue_depth"] != 1:              # b waits behind a ...
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert a.is_alive() and got["b"] == []                 # ... and hears nothing yet
    a.join(120)
    b.join(120)
    a_text = [t for t, c in got["a"] if c]
    b_text = [t for t, c in got["b"] if c]
    assert a_text[-1] < b_text[0]                          # b's first token came after a's last
    want = ref.generate(chat_ids(ref, HELLO), 20).text
    assert "".join(c or "" for _, c in got["b"]) == want
    slow.wait_idle()


def test_queue_full_is_503(slow):
    c = slow.client()
    a = c.chat.completions.create(model=NAME, messages=HELLO, max_tokens=400, temperature=0, stream=True)
    next(iter(a))                                          # a is generating
    b_ready = threading.Event()
    b_out = {}

    def waiting_client():
        with httpx.stream("POST", slow.url + "/v1/chat/completions", timeout=120,
                          json={"model": NAME, "messages": HELLO, "max_tokens": 5, "stream": True}) as r:
            b_ready.set()
            b_out["lines"] = [ln for ln in r.iter_lines() if ln]

    b = threading.Thread(target=waiting_client)
    b.start()
    assert b_ready.wait(10)
    deadline = time.monotonic() + 30
    while slow.metrics()["queue_depth"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r = httpx.post(slow.url + "/v1/chat/completions", json={"model": NAME, "messages": HELLO})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    a.close()                                              # a leaves: b runs next
    b.join(120)
    assert b_out["lines"][-1] == "data: [DONE]"
    slow.wait_idle()


def tokens_after(slow, t: float) -> int:
    """How many tokens the slow server's engine handed over after time t."""
    return sum(1 for y in slow.app.state.server.engine.yielded if y > t)


def test_disconnect_stops_generation(slow):
    before = slow.wait_idle()
    stream = slow.client().chat.completions.create(model=NAME, messages=HELLO, max_tokens=400,
                                                   temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 5:
            break
    t_close = time.monotonic()
    stream.close()
    after = slow.wait_idle()
    assert after["requests_cancelled_total"] == before["requests_cancelled_total"] + 1
    assert after["last_finish_reason"] == "cancelled" and after["last_completion_tokens"] < 400
    assert tokens_after(slow, t_close) <= 2      # the one in flight (+ one for scheduling jitter)
    time.sleep(5 * SLOW_S)
    assert slow.metrics()["completion_tokens_total"] == after["completion_tokens_total"]


def test_disconnect_while_waiting_for_a_whole_answer(slow):
    before = slow.wait_idle()
    with pytest.raises(httpx.ReadTimeout):      # the client gives up on a non-streamed request
        httpx.post(slow.url + "/v1/chat/completions", timeout=0.3,
                   json={"model": NAME, "messages": HELLO, "max_tokens": 400, "temperature": 0})
    t_close = time.monotonic()
    after = slow.wait_idle()
    assert after["requests_cancelled_total"] == before["requests_cancelled_total"] + 1
    assert after["last_finish_reason"] == "cancelled" and after["last_completion_tokens"] < 400
    assert tokens_after(slow, t_close) <= 2


def test_metrics(srv, ref):
    r = srv.client().chat.completions.create(model=NAME, messages=HELLO, max_tokens=8, temperature=0)
    m = srv.wait_idle()
    assert m["model"] == NAME and m["requests_completed_total"] >= 1 and m["last_decode_tok_s"] > 0
    assert (m["last_prompt_tokens"], m["last_completion_tokens"]) == (len(chat_ids(ref, HELLO)),
                                                                     r.usage.completion_tokens)
    assert m["experts"] == srv.app.state.server.engine.experts.stats()    # whatever the engine reports
    text = httpx.get(srv.url + "/metrics", params={"format": "prometheus"}).text
    assert "# TYPE moe_stream_completion_tokens_total counter" in text
    assert "moe_stream_queue_depth 0\n" in text and "moe_stream_experts_" in text
    assert httpx.get(srv.url + "/metrics", headers={"Accept": "text/plain"}).text.startswith("# TYPE")


def test_next_chat_turn_resumes_the_last_state(model_dir, ref):
    """With the prefix cache (the CLI's default), a chat's second turn prefills only what follows
    the ids the first turn ran through the model, even with another request between the turns;
    usage and metrics report them as cached."""
    s = ServerThread(create_app(engine.load(model_dir, device="cpu", prefix_cache=True), NAME))
    try:
        c = s.client()
        r1 = c.chat.completions.create(model=NAME, messages=HELLO, max_tokens=12, temperature=0)
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        turn2 = HELLO + [{"role": "assistant", "content": r1.choices[0].message.content},
                         {"role": "user", "content": "Again."}]
        # a UI's title request between the turns takes the live state; the turn resumes from
        # the copy saved before it did
        t = c.chat.completions.create(model=NAME, max_tokens=3, temperature=0, messages=[
            {"role": "system", "content": "Write a title."}, {"role": "user", "content": "Hello"}])
        r2 = c.chat.completions.create(model=NAME, messages=turn2, max_tokens=12, temperature=0)
        first = len(chat_ids(ref, HELLO))
        cached = r2.usage.prompt_tokens_details.cached_tokens
        assert first <= cached < r2.usage.prompt_tokens == len(chat_ids(ref, turn2))
        m = s.wait_idle()
        assert m["prompt_cached_tokens_total"] == cached + t.usage.prompt_tokens_details.cached_tokens
        assert m["prompt_cached_from_saved_total"] == 1
        assert m["prefix_saved_states"] >= 1 and m["prefix_saved_bytes"] > 0
        assert r2.choices[0].finish_reason in ("stop", "length")
    finally:
        s.stop()


# ---- bad input ------------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,status,param,says", [
    (b"{not json", 400, None, "not valid JSON"),
    ([1, 2], 400, None, "must be a JSON object, got array"),
    ({"messages": MSG}, 400, "model", "'model' is required"),
    ({"model": "gpt-4o", "messages": MSG}, 404, "model", "The model 'gpt-4o' does not exist"),
    ({"model": NAME}, 400, "messages", "'messages' is required"),
    ({"model": NAME, "messages": "hi"}, 400, "messages", "'messages' must be an array, got string"),
    ({"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role",
     "must be one of"),
    ({"model": NAME, "messages": [{"role": "user"}]}, 400, "messages[0].content", "is required"),
    ({"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content", "only text parts are supported (got 'image_url')"),
    ({"model": NAME, "messages": MSG, "max_tokens": "10"}, 400, "max_tokens",
     "must be an integer, got string"),
    ({"model": NAME, "messages": MSG, "max_tokens": -1}, 400, "max_tokens", "at least 1"),
    ({"model": NAME, "messages": MSG, "max_tokens": 2.5}, 400, "max_tokens", "got number"),
    ({"model": NAME, "messages": MSG, "temperature": 2.5}, 400, "temperature", "in [0, 2]"),
    ({"model": NAME, "messages": MSG, "temperature": "hot"}, 400, "temperature", "must be a number"),
    ({"model": NAME, "messages": MSG, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"model": NAME, "messages": MSG, "seed": -3}, 400, "seed", ">= 0"),
    ({"model": NAME, "messages": MSG, "stream": "yes"}, 400, "stream", "must be a boolean"),
    ({"model": NAME, "messages": MSG, "stop": 5}, 400, "stop", "string or an array of strings"),
    ({"model": NAME, "messages": MSG, "n": 2}, 400, "n", "'n' must be 1"),
    ({"model": NAME, "messages": MSG, "logprobs": True}, 400, "logprobs", "not supported"),
    ({"model": NAME, "messages": MSG, "max_tokens": 10 ** 30}, 400, "max_tokens",
     "maximum context length is 512 tokens"),
    ({"model": NAME, "messages": [{"role": "user", "content": "x" * 600}]}, 400, "messages",
     "no room for a completion"),
])
def test_bad_chat_requests(srv, body, status, param, says):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(srv.url + "/v1/chat/completions", headers={"Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and says in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_context_error_gives_the_numbers(srv, ref):
    n = len(chat_ids(ref, MSG))
    r = httpx.post(srv.url + "/v1/chat/completions", json={"model": NAME, "messages": MSG, "max_tokens": 600})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        f"This model's maximum context length is 512 tokens, but {n + 600} were requested ({n} in the "
        f"prompt, 600 in 'max_tokens'). Set 'max_tokens' to at most {512 - n}, or shorten the prompt.")
    assert r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body,says", [
    ({"model": NAME}, "'prompt' is required"),
    ({"model": NAME, "prompt": ""}, "'prompt' is empty"),
    ({"model": NAME, "prompt": ["a", "b"]}, "holds 2 prompts"),
    ({"model": NAME, "prompt": [1, 2, 999]}, "token id 999 is outside the vocabulary (0..258)"),
    ({"model": NAME, "prompt": "x", "echo": True}, "'echo' is not supported"),
])
def test_bad_completion_requests(srv, body, says):
    r = httpx.post(srv.url + "/v1/completions", json=body)
    assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_unknown_route_and_method_in_openai_shape(srv):
    r = httpx.get(srv.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(srv.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_api_key(model_dir):
    s = ServerThread(create_app(engine.load(model_dir, device="cpu"), NAME, api_key="sekret"))
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.get(s.url + "/v1/models", headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": NAME, "messages": MSG})
        assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        ok = s.client(api_key="sekret").chat.completions.create(model=NAME, messages=MSG, max_tokens=3)
        assert ok.usage.completion_tokens <= 3
        assert httpx.get(s.url + "/health").status_code == 200    # health and metrics stay open
    finally:
        s.stop()


def test_engine_failure_is_a_500_and_the_server_lives_on(model_dir):
    s = ServerThread(create_app(FailingEngine(model_dir, device="cpu"), NAME))
    try:
        body = {"model": NAME, "messages": MSG, "max_tokens": 10, "temperature": 0}
        r = httpx.post(s.url + "/v1/chat/completions", json=body)
        assert r.status_code == 500
        assert r.json()["error"] == {"message": "generation failed: RuntimeError: expert fetch failed",
                                     "type": "server_error", "param": None, "code": None}
        lines = [ln for ln in httpx.post(s.url + "/v1/chat/completions", json={**body, "stream": True}
                                         ).text.splitlines() if ln]
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["type"] == "server_error"
        assert lines[-1] == "data: [DONE]"
        m = s.wait_idle()
        assert (m["requests_failed_total"], m["last_finish_reason"], m["last_completion_tokens"]) == \
            (2, "failed", 3)
    finally:
        s.stop()


def test_cli_serves_and_refuses_bad_flags(model_dir, tmp_path, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "engine.serve", "--model", str(model_dir), "--port", str(port),
           "--device", "cpu", "--max-context", "128", "--api-key", "k"]
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stderr=err)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": "Bearer k"})
                break
            except httpx.ConnectError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        assert r.json()["data"][0]["id"] == "m"               # the folder's name
        assert r.json()["data"][0]["max_model_len"] == 128
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert main(["--model", str(model_dir / "missing")]) == 2
    assert "no such model folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--queue-size", "-1"])
    from engine.serve import parse_args
    assert parse_args(["--no-prefix-cache"]).no_prefix_cache
    assert not parse_args([]).no_prefix_cache
