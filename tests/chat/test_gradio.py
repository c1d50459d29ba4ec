"""`lmd gradio`: the page's event handlers driven directly, the Blocks wiring, and (slow) the served app via a client."""

from __future__ import annotations

import socket
import threading

import pytest

from lmd.chat.gradio_events import GENERATING, ChatEvents
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig
from tests.chat.conftest import ENGINE_OPTIONS

gr = pytest.importorskip("gradio")

GREEDY = GenerationConfig(temperature=0, max_new_tokens=8)


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_respond_streams_a_growing_reply_equal_to_the_engines(engine):
    events = ChatEvents(engine, GREEDY)
    updates = list(events.respond("Hi there", None, 0.0, 0.8, 8))
    session = updates[0][1]
    assert updates[0] == ([_user("Hi there"), _assistant("")], session, "", GENERATING)  # queued, shown at once
    streamed = [chat[-1]["content"] for chat, *_ in updates[:-1]]
    assert all(len(b) > len(a) and b.startswith(a) for a, b in zip(streamed, streamed[1:], strict=False))
    reference = engine.generate([_user("Hi there")], GREEDY).result()
    final_chat, final_session, textbox, status = updates[-1]
    assert final_session is session and textbox == ""
    assert final_chat == [_user("Hi there"), _assistant(reference.text)] == session.messages
    assert streamed[-1] == reference.text
    assert status == "8 tokens generated (length limit); prompt 32 tokens, 0 of them from the prefix cache"

    *_, (chat, _, _, status) = events.respond("Tell me more", session, 0.0, 0.8, 8)
    second = engine.generate([*final_chat, _user("Tell me more")], GREEDY).result()
    assert chat[-1] == _assistant(second.text)
    cached = session.last.usage.cached_tokens
    assert cached >= 32 + 8 - ENGINE_OPTIONS["cache_block_seq_len"] and f"{cached} of them from the prefix" in status


def test_stop_aborts_the_engine_request_and_keeps_the_partial_reply(chat_ws):
    """The engine takes one step per update the page has shown, so Stop lands mid-reply however loaded the machine."""
    engine = Engine(chat_ws, start=False, **ENGINE_OPTIONS)
    steps, done = threading.Semaphore(0), threading.Event()

    def stepper() -> None:
        while not done.is_set():
            if steps.acquire(timeout=0.05):
                engine.step()

    thread = threading.Thread(target=stepper, daemon=True)
    thread.start()
    try:
        events = ChatEvents(engine, GenerationConfig(temperature=0, ignore_eos=True))
        shown = []
        for update in events.respond("Hi there", None, 0.0, 0.8, 300):
            chat, session, _, status = update
            shown.append(chat[-1]["content"])
            if len(shown) == 3:
                events.stop(session)
            steps.release()
        assert status.startswith(f"{len(session.last.token_ids)} tokens generated (stopped)")
        assert session.last.finish_reason == "abort" and 2 <= len(session.last.token_ids) <= 3
        assert chat == session.messages and chat[-1] == _assistant(shown[-1])
        assert engine.stats().running == 0 and not session.generating
    finally:
        done.set()
        thread.join()
        engine.close()


def test_too_long_history_and_reset(chat_ws):
    with Engine(chat_ws, **{**ENGINE_OPTIONS, "session_len": 40}) as engine:
        events = ChatEvents(engine, GREEDY)
        *_, (chat, session, _, _) = events.respond("Hi there", None, 0.0, 0.8, 64)  # fills the 40 tokens
        [(same_chat, same_session, textbox, status)] = events.respond("Tell me more", session, 0.0, 0.8, 8)
        assert same_chat == chat and same_session is session and textbox == "Tell me more"  # nothing lost
        assert "over the 40 this session holds; press Reset" in status
        assert events.reset(session) == ([], session, "") and session.messages == []
        *_, (again, *_) = events.respond("Hi there", session, 0.0, 0.8, 64)
        assert again == chat


def test_build_app_wires_the_events(engine):
    from lmd.chat.gradio_app import build_app

    events = ChatEvents(engine, GenerationConfig(temperature=0.3, top_p=0.9, max_new_tokens=1000))
    app = build_app(events, title="test")
    fns = {fn.api_name: fn for fn in app.fns.values()}
    assert set(fns) == {"respond", "stop", "reset"}
    respond = fns["respond"]
    assert [type(b).__name__ for b in respond.inputs] == ["Textbox", "State", "Slider", "Slider", "Slider"]
    assert [type(b).__name__ for b in respond.outputs] == ["Chatbot", "State", "Textbox", "Markdown"]
    temperature, top_p, max_new_tokens = respond.inputs[2:]
    assert (temperature.value, top_p.value) == (0.3, 0.9)
    assert max_new_tokens.maximum == engine.max_len and max_new_tokens.value == engine.max_len  # 1000 capped
    assert fns["stop"].inputs == [respond.inputs[1]] and fns["reset"].inputs == [respond.inputs[1]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*no_silent_downcasting:Warning", "ignore:The copy keyword:Warning")
def test_served_app_through_gradio_client(engine, monkeypatch):
    from gradio_client import Client

    from lmd.chat.gradio_app import build_app

    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    app = build_app(ChatEvents(engine, GREEDY))
    port = _free_port()
    app.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, show_error=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)  # one client = one browser session
        first = engine.generate([_user("Hi there")], GREEDY).result().text
        chat, textbox, status = client.predict("Hi there", 0.0, 0.8, 8, api_name="/respond")
        assert _texts(chat) == ["Hi there", first] and textbox == "" and "8 tokens generated" in status
        job = client.submit("Tell me more", 0.0, 0.8, 8, api_name="/respond")
        streamed = [_texts(chat)[-1] for chat, _, _ in job]
        second = engine.generate([_user("Hi there"), _assistant(first), _user("Tell me more")], GREEDY).result().text
        assert streamed[-1] == second and len(set(streamed)) > 2  # the reply arrived in pieces
        assert client.predict(api_name="/reset") == ([], "")
        chat, _, _ = client.predict("Hi there", 0.0, 0.8, 8, api_name="/respond")
        assert _texts(chat) == ["Hi there", first]
    finally:
        app.close()


def _texts(chat: list[dict]) -> list[str]:
    """Message texts of a chatbot value as gradio_client returns it (content as a list of typed parts)."""
    return ["".join(part["text"] for part in m["content"]) for m in chat]
