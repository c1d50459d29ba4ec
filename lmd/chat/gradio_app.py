"""The `lmd gradio` page: a chatbot with streaming replies, Stop and Reset buttons, and sampling sliders.

gradio is imported inside `build_app` only, so the rest of lmd (and the engine) works where gradio is absent.
The page's logic lives in `ChatEvents` (lmd/chat/gradio_events.py); this file only lays the page out and wires events.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmd.chat.gradio_events import ChatEvents
from lmd.chat.session import ChatSession
from lmd.turbomind.gen_config import MAX_TEMPERATURE

if TYPE_CHECKING:
    import gradio as gr


def build_app(events: ChatEvents, title: str = "lmd chat") -> gr.Blocks:
    """The Blocks app; the reply event is exposed to API clients as `/respond` (also `/stop`, `/reset`)."""
    import gradio as gr

    config = events.gen_config
    max_len = events.engine.max_len
    concurrency = events.engine.workspace.engine.max_batch_size  # replies batched together by the engine
    with gr.Blocks(title=title) as app:
        gr.Markdown(f"### {title}")
        chatbot = gr.Chatbot(label="conversation", height=460)
        status = gr.Markdown("")
        textbox = gr.Textbox(placeholder="Type a message and press Enter", show_label=False, lines=1)
        with gr.Row():
            send = gr.Button("Send", variant="primary")
            stop = gr.Button("Stop")
            reset = gr.Button("Reset")
        with gr.Accordion("Sampling", open=False):
            temperature = gr.Slider(
                0.0, MAX_TEMPERATURE, value=config.temperature, step=0.05, label="temperature (0 = greedy)"
            )
            top_p = gr.Slider(0.05, 1.0, value=config.top_p, step=0.05, label="top_p (1 = off)")
            max_new_tokens = gr.Slider(
                1, max_len, value=min(config.max_new_tokens, max_len), step=1, label="max new tokens"
            )
        # Each browser session starts with None; `respond` creates its ChatSession (gradio deep-copies initial values,
        # and a session holds the engine) and hands it back at its first update, before any token.
        session = gr.State(None, delete_callback=_abort)
        gr.on(
            [textbox.submit, send.click],
            events.respond,
            inputs=[textbox, session, temperature, top_p, max_new_tokens],
            outputs=[chatbot, session, textbox, status],
            api_name="respond",
            concurrency_limit=concurrency,
        )
        stop.click(events.stop, inputs=[session], outputs=None, api_name="stop", concurrency_limit=None)
        reset.click(
            events.reset, inputs=[session], outputs=[chatbot, session, status], api_name="reset", concurrency_limit=None
        )
    return app


def _abort(session: ChatSession | None) -> None:
    """A closed browser tab stops its reply in flight."""
    if session is not None:
        session.abort()
