"""python -m engine.chat: the terminal chat on a tiny random qwen3_moe with a ChatML template
(CPU): a turn is the engine's answer to the templated conversation, the next turn resumes the
state (only what follows the ids already in the model is prefilled), /reset, a conversation that
outgrows the context, a model without a chat template."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

import engine
from engine.chat import Chat, main
from engine.demo import DEMO_CONFIG, build_random_model
from engine.runtime import GenerationParams

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONFIG = dict(DEMO_CONFIG, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_experts=4, max_position_embeddings=512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"weights seed {seed}")
    d = build_random_model(tmp_path_factory.mktemp("chat") / "m", CONFIG, seed=seed)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def template_ids(m, msgs) -> list:
    return m.tokenizer.encode(m.tokenizer.apply_chat_template(msgs, True), add_special_tokens=False)


def test_turns_resume_and_answer_as_the_engine(model_dir):
    m = engine.load(model_dir, device="cpu")
    fresh = engine.load(model_dir, device="cpu")
    chat = Chat(m, "Be brief.", GenerationParams(12, 0.0), {})
    out = io.StringIO()
    s1 = chat.say("Hi there", out)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    first = template_ids(m, msgs)
    want = fresh.generate(first, max_new_tokens=12)
    reply = [t for t in want.output_ids if t not in m.eos_ids]
    assert out.getvalue() == fresh.tokenizer.decode(reply) + "\n"
    assert (s1["prefill_tokens"], s1["prefill_cached_tokens"]) == (len(first), 0)
    assert chat.turns[-1] == {"role": "assistant", "content": fresh.tokenizer.decode(reply)}
    s2 = chat.say("And again?", io.StringIO())
    second = template_ids(m, msgs + chat.turns[1:2] + [{"role": "user", "content": "And again?"}])
    assert s2["prefill_tokens"] == len(second)
    assert s2["prefill_cached_tokens"] >= len(first)   # the first turn's prompt at least
    assert len(chat.turns) == 4
    chat.reset()
    assert chat.turns == []


def test_oldest_turns_leave_a_full_context(model_dir):
    m = engine.load(model_dir, device="cpu", max_context=96)
    chat = Chat(m, None, GenerationParams(8, 0.0), {})
    for i in range(6):   # an exchange takes some 40-50 ids of the 96
        ids, drop = chat.prompt_ids(f"message number {i}")
        s = chat.say(f"message number {i}", io.StringIO())
        assert s["prefill_tokens"] == len(ids) <= 96 - 8
        if i >= 2:
            assert drop >= 1
    assert chat.turns[-2] == {"role": "user", "content": "message number 5"}
    assert len(chat.turns) <= 4


def test_cli_loop(model_dir, capsys):
    stdin = io.StringIO("Hi\n\nAgain\n/reset\nHi\n/exit\nnever read\n")
    out = io.StringIO()
    assert main(["--model", str(model_dir), "--device", "cpu", "--temperature", "0",
                 "--max-new-tokens", "6"], stdin=stdin, stdout=out) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("[")]
    assert len(lines) == 3 and "(conversation cleared)" in err
    assert " 0 resumed" in lines[0] and " 0 resumed" not in lines[1]
    assert stdin.readline() == "never read\n"


def test_no_chat_template_is_refused(tmp_path, capsys):
    d = build_random_model(tmp_path / "m", CONFIG)
    assert main(["--model", str(d), "--device", "cpu"], stdin=io.StringIO("Hi\n")) == 2
    assert "no chat template" in capsys.readouterr().err


def test_ctrl_c_stops_the_reply_not_the_chat(model_dir, capsys):
    """Ctrl-C during a reply keeps what came so far as the answer and the chat goes on (the next
    turn resumes the state); a refused turn leaves the history as it was; Ctrl-C at the prompt
    leaves with status 0."""
    m = engine.load(model_dir, device="cpu")
    chat = Chat(m, None, GenerationParams(12, 0.0), {})
    stream = m.stream

    def interrupted(ids, params, stats):
        for i, t in enumerate(stream(ids, params, stats)):
            if i == 3:
                raise KeyboardInterrupt
            yield t
    m.stream = interrupted
    s = chat.say("Hi", io.StringIO())
    assert s["interrupted"] and len(chat.turns) == 2 and chat.turns[1]["content"]
    m.stream = stream
    s2 = chat.say("More", io.StringIO())
    assert s2["prefill_cached_tokens"] > 0 and len(chat.turns) == 4
    before = list(chat.turns)
    m.max_context = 8    # the next prompt cannot fit: refused, and nothing is cut
    with pytest.raises(ValueError):
        chat.say("x " * 40, io.StringIO())
    assert chat.turns == before

    class CtrlC(io.StringIO):
        def readline(self, *a):
            raise KeyboardInterrupt
    assert main(["--model", str(model_dir), "--device", "cpu"], stdin=CtrlC()) == 0


def test_template_sources_in_order(tmp_path):
    """chat_template.jinja, then tokenizer_config.json's chat_template, then an image-text
    model's chat_template.json (Qwen-VL releases): the first that is there is the template."""
    import json

    from engine.tokenizer import load_tokenizer
    d = build_random_model(tmp_path / "m", CONFIG)
    tok = d / "tokenizer.json"
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "json:{{ messages[0].content }}"}))
    hi = [{"role": "user", "content": "hi"}]
    assert load_tokenizer(d, tok).apply_chat_template(hi) == "json:hi"
    from engine.pack import pack   # a packed folder keeps it
    pack(d, tmp_path / "p", "bf16", progress=False)
    assert load_tokenizer(tmp_path / "p", tmp_path / "p" / "tokenizer.json").apply_chat_template(hi) == "json:hi"
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "cfg:{{ 1 }}"}))
    assert load_tokenizer(d, tok).apply_chat_template(hi) == "cfg:1"
    (d / "chat_template.jinja").write_text("jinja")
    assert load_tokenizer(d, tok).apply_chat_template(hi) == "jinja"
