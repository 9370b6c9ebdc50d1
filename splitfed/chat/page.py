"""The chat page (Gradio): a conversation whose answers stream in token by token from a :class:`ChatEngine`.

Each event runs on a worker thread of Gradio's and no concurrency limit is set on
it, so the answers of several browser sessions are generated at once (and their
decode steps batch on the trunk server). The page needs nothing from the
internet: its fonts are the browser's own, and Gradio's analytics are off.
"""

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from splitfed.chat.engine import ChatEngine
from splitfed.errors import SplitFedError
from splitfed.extras import require

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

log = logging.getLogger(__name__)

#: Element ids the page's parts carry (for scripts and tests).
PROMPT_ID, SEND_ID, CHAT_ID = "splitfed-prompt", "splitfed-send", "splitfed-chat"
#: The title of the message that shows why an answer failed (a Gradio "thought" message, shown open).
FAILED_TITLE = "\u26a0 this answer failed"


def failed(message: Mapping[str, Any]) -> bool:
    """Whether a chat message is the page's note that an answer failed."""
    metadata = message.get("metadata") or {}
    return isinstance(metadata, Mapping) and metadata.get("title") == FAILED_TITLE


def completed(history: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The exchanges of ``history`` whose answer did not fail: a failed one (its user message, what its answer
    showed, and the note that it failed) is left out of later prompts, so it neither adds an empty or cut-off
    answer for the model to imitate nor makes the prompt grow with a message that failed."""
    kept: list[Mapping[str, Any]] = []
    exchange: list[Mapping[str, Any]] = []
    for message in [*history, {"role": "user"}]:
        if message.get("role") == "user":
            if not any(failed(m) for m in exchange):
                kept += exchange
            exchange = []
        exchange.append(message)
    return kept


def theme() -> Any:
    """Gradio's default theme with the browser's own fonts (the default fetches web fonts)."""
    gr = require("gradio", "the chat page")

    return gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                             font_mono=["ui-monospace", "monospace"])


def build_page(engine: ChatEngine, *, title: str = "splitfed chat") -> Any:
    """The page's ``gradio.Blocks`` (not launched)."""
    gr = require("gradio", "the chat page")

    where = engine.connection.address
    with gr.Blocks(title=title, analytics_enabled=False) as page:
        gr.Markdown(f"### {title}\n`{engine.model}`: the first and last blocks run in this page's process, blocks "
                    f"{engine.cuts[0]}..{engine.cuts[1] - 1} on the trunk server at `{where}`.")
        chatbot = gr.Chatbot(elem_id=CHAT_ID, height=460, render_markdown=False, label="conversation",
                             feedback_options=None)
        with gr.Row():
            box = gr.Textbox(elem_id=PROMPT_ID, placeholder="Type a message and press Enter", show_label=False,
                             scale=8, autofocus=True)
            send = gr.Button("Send", elem_id=SEND_ID, variant="primary", scale=1)
        with gr.Accordion("Generation", open=False):
            max_new = gr.Slider(1, engine.max_new_tokens, value=min(64, engine.max_new_tokens), step=1,
                                label="max new tokens")
            temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0: greedy)")
        gr.ClearButton([box, chatbot], value="Clear")

        def respond(message: str, history: list[dict[str, Any]] | None, max_new_tokens: float, temp: float,
                    request: gr.Request) -> Iterator[tuple[str, list[dict[str, Any]]]]:
            message = (message or "").strip()
            past = list(history or [])
            if not message:
                yield "", past
                return
            turns = past + [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
            yield "", turns
            try:
                for text in engine.stream(request.session_hash or "anonymous", completed(past), message,
                                          max_new_tokens=int(max_new_tokens), temperature=float(temp)):
                    turns[-1] = {"role": "assistant", "content": text}
                    yield "", turns
            except Exception as exc:  # noqa: BLE001 - shown on the turn; the page serves on
                if isinstance(exc, SplitFedError):
                    log.warning("an answer failed: %s", exc)
                    why = str(exc)
                else:
                    log.exception("an answer failed")
                    why = f"{type(exc).__name__}: {exc}"
                note = {"role": "assistant", "content": why, "metadata": {"title": FAILED_TITLE}}
                if turns[-1]["content"]:
                    turns.append(note)  # what came before the failure stays shown
                else:
                    turns[-1] = note
                yield "", turns

        for trigger in (box.submit, send.click):
            trigger(respond, [box, chatbot, max_new, temperature], [box, chatbot], concurrency_limit=None,
                    api_name=False)

        def ended(request: gr.Request) -> None:
            if request.session_hash:
                engine.end(request.session_hash)
        page.unload(ended)
    page.queue(default_concurrency_limit=None)
    return page
