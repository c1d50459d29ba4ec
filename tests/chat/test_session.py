"""ChatSession: whole-history turns that reuse the prefix cache, reset, system prompt, too-long history, aborts."""

from __future__ import annotations

import pytest

from lmd.chat.session import ChatSession, ConversationTooLong
from lmd.errors import LmdError
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig
from tests.chat.conftest import BLOCK, ENGINE_OPTIONS

GREEDY = GenerationConfig(temperature=0, max_new_tokens=8)


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_second_turn_reuses_the_first_turns_kv_and_equals_generate_on_the_history(engine):
    session = ChatSession(engine, GREEDY)
    first = session.chat("Hi there")
    first_prompt = engine.encode([_user("Hi there")])
    assert first.token_ids == engine.generate([_user("Hi there")], GREEDY).result().token_ids
    history = session.messages
    assert history == [_user("Hi there"), {"role": "assistant", "content": first.text}]
    # The premise of the reuse: the reply re-tokenizes to what was generated, so turn 2's prompt extends turn 1's.
    seen = first_prompt + first.token_ids
    assert engine.encode([*history, _user("Tell me more")])[: len(seen)] == seen

    hits_before = engine.stats().prefix_hit_tokens
    second = session.chat("Tell me more")
    reused = engine.stats().prefix_hit_tokens - hits_before
    assert reused >= len(seen) - BLOCK
    assert second.usage.cached_tokens == reused
    reference = engine.generate([*history, _user("Tell me more")], GREEDY).result()
    assert second.token_ids == reference.token_ids and second.text == reference.text
    assert session.messages == [*history, _user("Tell me more"), {"role": "assistant", "content": second.text}]


def test_reset_starts_over_and_keeps_the_system_prompt(engine):
    system = {"role": "system", "content": "You answer in one word."}
    session = ChatSession(engine, GREEDY, system=system["content"])
    first = session.chat("Hi there")
    assert first.token_ids == engine.generate([system, _user("Hi there")], GREEDY).result().token_ids
    session.chat("And then?")
    assert len(session.messages) == 5
    session.reset()
    assert session.messages == [system] and session.last is None
    assert session.chat("Hi there").token_ids == first.token_ids


def test_a_history_over_session_len_is_refused_and_kept(chat_ws):
    with Engine(chat_ws, **{**ENGINE_OPTIONS, "session_len": 40}) as engine:
        session = ChatSession(engine, GenerationConfig(temperature=0, max_new_tokens=64))
        first = session.chat("Hi there")  # a 32-token prompt: the reply stops where the session is full
        assert first.finish_reason == "length" and first.usage.total_tokens == 40 and session.is_full
        history = session.messages
        with pytest.raises(ConversationTooLong, match=r"is \d+ tokens with this message, over the 40 .*`reset`") as exc:
            session.stream("Tell me more")
        assert exc.value.limit == 40 and exc.value.tokens > 40
        assert session.messages == history and not session.generating
        session.reset()
        assert session.chat("Hi there").token_ids == first.token_ids


def test_a_stopped_reply_keeps_what_was_shown(chat_ws):
    with Engine(chat_ws, start=False, **ENGINE_OPTIONS) as engine:  # the test drives the steps: no races
        session = ChatSession(engine, GenerationConfig(temperature=0, max_new_tokens=50, ignore_eos=True))
        deltas = session.stream("Hi there")
        with pytest.raises(LmdError, match="still being generated"):
            session.stream("Another")
        for _ in range(3):
            engine.step()
        shown = "".join(next(deltas).text for _ in range(3))
        session.abort()
        engine.step()
        rest = list(deltas)
        assert [d.finish_reason for d in rest] == ["abort"]
        assert session.last.finish_reason == "abort" and len(session.last.token_ids) == 3
        assert session.messages[-1] == {"role": "assistant", "content": shown + rest[0].text}
        assert engine.stats().running == 0 and not session.generating


def test_a_reply_stopped_before_any_text_drops_the_turn(chat_ws):
    with Engine(chat_ws, start=False, **ENGINE_OPTIONS) as engine:
        session = ChatSession(engine, GREEDY)
        deltas = session.stream("Hi there")
        session.abort()
        engine.step()
        assert [d.finish_reason for d in deltas] == ["abort"]
        assert session.messages == [] and session.last.text == ""


def test_reset_while_a_reply_streams_aborts_it_and_stays_empty(chat_ws):
    with Engine(chat_ws, start=False, **ENGINE_OPTIONS) as engine:
        session = ChatSession(engine, GenerationConfig(temperature=0, max_new_tokens=50, ignore_eos=True))
        deltas = session.stream("Hi there")
        engine.step()
        next(deltas)
        session.reset()  # e.g. the web page's Reset button while the reply is streaming
        engine.step()
        assert [d.finish_reason for d in deltas] == ["abort"]
        assert session.messages == [] and session.last is None and not session.generating


def test_closing_the_stream_early_aborts_the_request(chat_ws):
    with Engine(chat_ws, start=False, **ENGINE_OPTIONS) as engine:
        session = ChatSession(engine, GenerationConfig(temperature=0, max_new_tokens=50, ignore_eos=True))
        deltas = session.stream("Hi there")
        engine.step()
        first = next(deltas)
        deltas.close()  # what Ctrl-C in the terminal or a dropped web client does
        assert session.last.finish_reason == "abort" and not session.generating
        engine.step()
        assert engine.stats().running == 0 and engine.stats().blocks_used == 0
        assert session.messages[-1]["content"] == first.text


def test_empty_message_is_refused(engine):
    with pytest.raises(LmdError, match="message is empty"):
        ChatSession(engine).stream("   ")
