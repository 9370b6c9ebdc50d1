"""The chat page: answers stream token by token and equal the unsplit model's greedy generate, in the engine and in
a real headless browser (Debian's Chromium driven by Playwright), for the docs' commands and for two browser
sessions at once, whose decode steps batch on the trunk server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from llm_fixtures import save_tiny

CUTS = (1, 3)
LETTERS = "abcdefghijklmnopqrstuvwxyz"
CHROMIUM = "/usr/bin/chromium"
#: The browser's flags: headless, no sandbox (root in CI), nothing that reaches out to the network.
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]


def _browser_or_skip() -> Any:
    """Playwright's sync API, with Debian's Chromium; CI installs both (.ci/run), so there a missing one fails."""
    missing = []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing.append("playwright (pip install playwright)")
        sync_playwright = None
    if not os.path.exists(CHROMIUM):
        missing.append("chromium (apt-get install -y chromium)")
    if missing:
        if os.environ.get("CI"):
            pytest.fail("the browser test needs " + " and ".join(missing))
        pytest.skip("the browser test needs " + " and ".join(missing))
    return sync_playwright


def save_letters_llama(folder: Path) -> Path:
    """A tiny Llama with the byte tokenizer whose head can only pick the letters a-z (so answers are plain text
    that a page shows as is)."""
    import transformers as tf

    save_tiny("llama", folder, layers=4, seed=0)
    model = tf.AutoModelForCausalLM.from_pretrained(folder)
    tok = tf.AutoTokenizer.from_pretrained(folder)
    letters = torch.tensor([tok.convert_tokens_to_ids(c) for c in LETTERS])
    with torch.no_grad():
        keep = torch.zeros(model.lm_head.weight.shape[0], dtype=torch.bool)
        keep[letters] = True
        model.lm_head.weight[~keep] = 0.0
        model.lm_head.weight[keep] *= 20.0
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_letters_llama(tmp_path_factory.mktemp("chat") / "tiny-llama")


def greedy(folder: Path, prompt: str, new: int) -> str:
    """The unsplit model's greedy answer to ``prompt``, as text."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = tf.AutoTokenizer.from_pretrained(folder)
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, do_sample=False, max_new_tokens=new, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert len(text) == new and set(text) <= set(LETTERS), text  # one letter per token
    return text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def trunk(llama: Path) -> Iterator[Any]:
    """The tiny Llama's trunk on a server that batches decode steps arriving within 50 ms."""
    from splitfed.models import partload
    from splitfed.channel.server.trunkserver import TrunkServer

    parts = partload.load_parts(str(llama), CUTS, ("trunk",))
    server = TrunkServer(parts.trunk.requires_grad_(False), insecure=True, model_name=str(llama), cuts=CUTS,
                         batch_window_ms=50).start()
    yield server
    server.stop(grace=0)


# -- the engine -------------------------------------------------------------------------------------------
def test_engine_streams_the_unsplit_greedy_answer_token_by_token(llama: Path, trunk: Any) -> None:
    from splitfed.chat.engine import ChatEngine, Connection

    # Prepare
    want = greedy(llama, "hello there", 16)
    engine = ChatEngine(str(llama), Connection(trunk.address, insecure=True, model=str(llama)))
    # Execute
    texts = list(engine.stream("s1", [], "hello there", max_new_tokens=16))
    # Assert: one text per token, each the one before plus a letter, the last the unsplit model's answer; the
    # engine took the server's cuts and the session is closed
    assert engine.cuts == CUTS
    assert texts == [want[:n] for n in range(1, 17)]
    assert len(trunk.servicer.sessions) == 0
    engine.close()


def test_engine_stops_generating_when_the_reader_stops(llama: Path, trunk: Any) -> None:
    from splitfed.chat.engine import ChatEngine, Connection

    engine = ChatEngine(str(llama), Connection(trunk.address, insecure=True, model=str(llama)), max_new_tokens=200)
    answer = engine.stream("s1", [], "stop early", max_new_tokens=200)
    assert len(next(answer)) == 1
    answer.close()  # the page went away
    deadline = time.monotonic() + 30
    while len(trunk.servicer.sessions) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(trunk.servicer.sessions) == 0  # its server session was closed
    assert trunk.servicer.sessions.stats["steps"] < 200
    engine.close()


def test_engine_refuses_cuts_the_server_does_not_serve(llama: Path, trunk: Any) -> None:
    from splitfed.chat.engine import ChatEngine, Connection
    from splitfed.errors import ConfigError

    with pytest.raises(ConfigError, match="serves cuts 1,3; pass --cuts 1,3"):
        ChatEngine(str(llama), Connection(trunk.address, insecure=True), cuts=(2, 3))


# -- in a browser -------------------------------------------------------------------------------------------
#: Records every text the last answer shows, as the page changes (the answer streams in).
WATCH = """() => {
  window.shown = [];
  const chat = document.querySelector('#splitfed-chat');
  new MutationObserver(() => {
    const bots = chat.querySelectorAll('[data-testid=bot]');
    if (bots.length) window.shown.push(bots[bots.length - 1].textContent.trim());
  }).observe(chat, {subtree: true, childList: true, characterData: true});
}"""


def _ask(page: Any, url: str, prompt: str) -> None:
    page.goto(url)
    page.wait_for_selector("#splitfed-prompt textarea", timeout=60_000)
    page.evaluate(WATCH)
    page.fill("#splitfed-prompt textarea", prompt)


def _answer(page: Any, want: str) -> list[str]:
    """Wait until the page shows ``want`` as the answer; the texts it showed on the way."""
    page.wait_for_function("(want) => window.shown.length && window.shown[window.shown.length - 1] === want",
                           arg=want, timeout=120_000)
    return [t for t in page.evaluate("window.shown") if t]


def _wait_page(url: str, proc: subprocess.Popen[str], timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"the chat page did not come up at {url}")


@pytest.mark.slow  # CI: the engine streams (test_engine_streams_...), the page shows it in the browser (two sessions)
def test_docs_commands_serve_a_page_whose_answer_streams_in(llama: Path) -> None:
    sync_playwright = _browser_or_skip()
    # Prepare: the docs' two commands, a trunk server and the page
    want = greedy(llama, "hello there", 32)
    port, page_port = _free_port(), _free_port()
    serve = subprocess.Popen([sys.executable, "-m", "splitfed.cli", "serve", "--model", str(llama), "--cuts", "1,3",
                              "--port", str(port), "--insecure", "--batch-window-ms", "20"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    chat = None
    try:
        from splitfed.channel.client.trunk import TrunkClient

        TrunkClient(f"127.0.0.1:{port}", insecure=True).wait_ready(240)
        chat = subprocess.Popen([sys.executable, "-m", "splitfed.cli", "chat", "--server", f"127.0.0.1:{port}",
                                 "--model", str(llama), "--insecure", "--port", str(page_port),
                                 "--max-new-tokens", "32"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{page_port}/"
        _wait_page(url, chat)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
            page = browser.new_page()
            # Execute: type a prompt and press Enter
            _ask(page, url, "hello there")
            page.press("#splitfed-prompt textarea", "Enter")
            shown = _answer(page, want)
            browser.close()
        # Assert: the answer came in pieces, each the start of the next, and ends as the unsplit greedy answer
        prefixes = [t for t in dict.fromkeys(shown) if want.startswith(t)]
        assert prefixes[-1] == want and len(prefixes) >= 4, shown
        assert all(want.startswith(t) for t in shown), shown
    finally:
        for proc in (chat, serve):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        outs = [proc.communicate(timeout=60)[0] for proc in (chat, serve) if proc is not None]
    assert chat is not None and chat.returncode == 0 and serve.returncode == 0, [o[-2000:] for o in outs]


def test_two_browser_sessions_at_once_batch_their_decode_steps(llama: Path, trunk: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    sync_playwright = _browser_or_skip()
    from splitfed.chat import serve_page
    from splitfed.chat.engine import ChatEngine, Connection
    from splitfed.client import generation

    # Prepare: the page in this process, two browser sessions (contexts of their own)
    prompts = ("hello there", "what now")
    want = [greedy(llama, p, 32) for p in prompts]
    # The two answers start together however a loaded machine spaces the page's requests (one answer could
    # otherwise end before the other's request is in, and no step would have a partner to batch with).
    together, real = threading.Barrier(len(prompts), timeout=120), generation.generate

    def at_once(*args: Any, **kwargs: Any) -> Any:
        together.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "generate", at_once)
    engine = ChatEngine(str(llama), Connection(trunk.address, insecure=True, model=str(llama)), max_new_tokens=32)
    page_port = _free_port()
    site = serve_page(engine, port=page_port)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
            pages = [browser.new_context().new_page() for _ in prompts]
            for page, prompt in zip(pages, prompts):
                _ask(page, f"http://127.0.0.1:{page_port}/", prompt)
            # Execute: both send at once
            for page in pages:
                page.press("#splitfed-prompt textarea", "Enter")
            shown = [_answer(page, w) for page, w in zip(pages, want)]
            browser.close()
    finally:
        site.close()
        engine.close()
    # Assert: each session got its own greedy answer, streamed; the server stacked their decode steps
    for texts, w in zip(shown, want):
        assert texts[-1] == w and len(set(texts)) >= 4 and all(w.startswith(t) for t in texts), (texts, w)
    stats = trunk.servicer.sessions.stats
    assert stats["batched_steps"] >= 8, stats
    assert len(trunk.servicer.sessions) == 0


def test_chat_command_says_what_to_install_without_gradio(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from splitfed.cli.main import main

    monkeypatch.setitem(sys.modules, "gradio", None)  # import gradio fails as if not installed
    assert main(["chat", "--server", "127.0.0.1:1", "--model", "x", "--insecure"]) == 1
    assert "pip install 'splitfed[ui]'" in capsys.readouterr().err


#: The texts of the page's answers, in order (a JavaScript expression).
BOTS = "[...document.querySelectorAll('#splitfed-chat [data-testid=bot]')].map(b => b.textContent.trim())"
#: How many error toasts the page shows (a JavaScript expression).
TOASTS = "document.querySelectorAll('[data-testid=toast-body]').length"
#: A plain chat template (the tiny tokenizer has none): each turn as "role: text", then the answer's start.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def test_a_failed_answer_shows_its_error_on_its_turn_and_the_next_turn_answers(llama: Path) -> None:
    sync_playwright = _browser_or_skip()
    from splitfed.models import partload
    from splitfed.channel.server.trunkserver import TrunkServer
    from splitfed.chat import serve_page
    from splitfed.chat.engine import ChatEngine, Connection
    from splitfed.trunk.inference.sessions import SessionLimits

    # Prepare: a server whose sessions hold at most 80 positions (a long message's answer is refused), a page
    # whose tokenizer has a chat template (the whole conversation makes the prompt)
    parts = partload.load_parts(str(llama), CUTS, ("trunk",))
    server = TrunkServer(parts.trunk.requires_grad_(False), insecure=True, model_name=str(llama), cuts=CUTS,
                         session_limits=SessionLimits(max_length=80)).start()
    engine = ChatEngine(str(llama), Connection(server.address, insecure=True, model=str(llama)), max_new_tokens=16)
    engine.tokenizer.chat_template = TEMPLATE
    # the answer to the second message alone: the failed exchange is no part of its prompt
    want = greedy(llama, engine.tokenizer.apply_chat_template([{"role": "user", "content": "what now"}],
                                                              tokenize=False, add_generation_prompt=True), 16)
    page_port = _free_port()
    site = serve_page(engine, port=page_port)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
            page = browser.new_page()
            # Execute: a message too long for the server's sessions, then a short one
            _ask(page, f"http://127.0.0.1:{page_port}/", "tell me " * 8)
            page.press("#splitfed-prompt textarea", "Enter")
            page.wait_for_function("() => document.querySelector('[data-testid=toast-body]') || " + BOTS
                                   + ".some(b => b.includes('max_length must be between 1 and 80'))", timeout=60_000)
            first = page.evaluate(BOTS)
            page.evaluate(WATCH)
            toasts = page.evaluate(TOASTS)
            page.fill("#splitfed-prompt textarea", "what now")
            page.press("#splitfed-prompt textarea", "Enter")
            page.wait_for_function("([want, toasts]) => { const b = " + BOTS + "; return " + TOASTS + " > toasts || "
                                   "b.length > 1 && (b[b.length - 1] === want || b[b.length - 1].includes('this answer "
                                   "failed')); }", arg=[want, toasts], timeout=60_000)
            assert page.evaluate(TOASTS) <= toasts, "the second answer failed as an error toast"
            shown = [t for t in page.evaluate("window.shown") if t and "this answer failed" not in t]
            bots = page.evaluate(BOTS)
            browser.close()
    finally:
        site.close()
        engine.close()
        server.stop(grace=0)
    # Assert: the failed turn shows why it failed; the next one streamed the answer to a prompt without it
    assert len(first) == 1 and "this answer failed" in first[0] and "max_length" in first[0], first
    assert len(bots) == 2 and bots[0] == first[0], bots
    assert bots[1] == want and len(set(shown)) >= 4 and all(want.startswith(t) for t in shown), shown


def test_the_prompt_leaves_out_failed_exchanges() -> None:
    from splitfed.chat.page import FAILED_TITLE, completed

    ok = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    failed_empty = [{"role": "user", "content": "c"},
                    {"role": "assistant", "content": "boom", "metadata": {"title": FAILED_TITLE, "log": None}}]
    failed_late = [{"role": "user", "content": "d"}, {"role": "assistant", "content": "par"},
                   {"role": "assistant", "content": "boom", "metadata": {"title": FAILED_TITLE}}]
    assert completed(ok + failed_empty + ok + failed_late) == ok + ok
    assert completed([]) == []
