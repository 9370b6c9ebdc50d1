"""``splitfed chat``: a chat page over a split LLM whose trunk runs on a trunk server (the ``[ui]`` extra: Gradio)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the page's modules load torch and Gradio: imported when the page starts
    from splitfed.chat.engine import ChatEngine

__all__ = ["add_parser", "serve_page"]

log = logging.getLogger("splitfed")


def _cuts(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cuts must be two integers A,B, got {text!r}") from None
    return a, b


def add_parser(sub: Any) -> None:
    """Register ``splitfed chat`` on the CLI's subparsers."""
    chat = sub.add_parser("chat", help="a chat page (Gradio) over a split LLM: bottom and top here, the trunk on "
                                       "--server")
    chat.add_argument("--server", required=True, help="host:port of the trunk server (or of a router)")
    chat.add_argument("--model", required=True, help="named LLM or local folder with the weights and tokenizer")
    chat.add_argument("--served-as", default=None,
                      help="the model's name on the server, sent with every call (default: --model)")
    chat.add_argument("--cuts", type=_cuts, help="cut points A,B (default: the ones the server serves)")
    chat.add_argument("--insecure", action="store_true", help="plaintext to --server (loopback and tests only)")
    chat.add_argument("--tls-ca", help="root CA that signs the trunk server's certificate (default: system roots)")
    chat.add_argument("--token", help="bearer token for a trunk server that requires one")
    chat.add_argument("--host", default="127.0.0.1", help="address the page listens on")
    chat.add_argument("--port", type=int, default=7860, help="port the page listens on")
    chat.add_argument("--max-new-tokens", type=int, default=256, help="the most tokens one answer may have")
    chat.set_defaults(func=_chat)


def serve_page(engine: ChatEngine, host: str = "127.0.0.1", port: int = 7860) -> Any:
    """Build and launch the page for ``engine`` without blocking; returns the launched ``gradio.Blocks``
    (``page.local_url`` is its address; ``page.close()`` stops it)."""
    from splitfed.chat.page import build_page, theme

    page = build_page(engine)
    page.launch(server_name=host, server_port=port, prevent_thread_lock=True, quiet=True, share=False,
                theme=theme(), footer_links=[], show_error=True)
    return page


def _chat(args: argparse.Namespace) -> int:
    from splitfed.errors import MissingExtraError
    from splitfed.extras import require

    try:
        require("gradio", "the chat page")
    except MissingExtraError as exc:
        raise SystemExit(str(exc)) from None
    from splitfed.chat.engine import ChatEngine, Connection

    connection = Connection(args.server, insecure=args.insecure, tls_ca=args.tls_ca, token=args.token,
                            model=args.model if args.served_as is None else args.served_as)
    engine = ChatEngine(args.model, connection, cuts=args.cuts, max_new_tokens=args.max_new_tokens)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the page's own requests to itself
    page = serve_page(engine, args.host, args.port)
    log.info("chat page for %s on %s (trunk at %s)", args.model, page.local_url, args.server)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    try:
        stopped.wait()
    except KeyboardInterrupt:
        pass
    finally:
        page.close()
        engine.close()
    return 0
