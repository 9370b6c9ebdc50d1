"""The chat page's model side: the bottom and top in this process, the trunk on a trunk server; answers stream as text.

:class:`ChatEngine` loads only the client's parts of a causal LM (at the cuts the
server serves) and its tokenizer, and answers a conversation with split
generation (:func:`splitfed.client.generation.generate` over a
:class:`~splitfed.client.generation.RemoteSession`): the trunk's KV cache lives on the
server. Each browser session has its own :class:`~splitfed.channel.client.trunk.TrunkClient`
(its own client id, so a router pins each to a backend by load), and each answer
runs on a thread of its own: answers of several sessions reach the server at the
same time, where its batched decoding stacks their steps (``--batch-window-ms``).

The prompt is the conversation in the tokenizer's chat template when it has one,
else the last message alone (a base model continues the text).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from splitfed.errors import ConfigError, SplitFedError

log = logging.getLogger(__name__)


class AnswerCancelled(SplitFedError):
    """The page stopped reading an answer (the browser went away): its generation ends at the next token."""


@dataclass(frozen=True)
class Connection:
    """How the page reaches the trunk server.

    Args:
        address: ``host:port`` of the trunk server (or of a router in front of several).
        insecure: plaintext (loopback and tests only); else TLS verified with ``tls_ca`` (system roots when None).
        token: bearer token for a server that requires one.
        model: the name the server holds the model under (sent as ``x-splitfed-model``; empty: none sent).
    """

    address: str
    insecure: bool = False
    tls_ca: str | None = None
    token: str | None = None
    model: str = ""

    def client(self, client_id: str | None = None) -> Any:
        """A trunk client over this connection."""
        from splitfed.channel.client.trunk import TrunkClient

        credentials = None
        if not self.insecure:
            from splitfed.channel.security.credentials import channel_credentials

            credentials = channel_credentials(self.tls_ca)
        return TrunkClient(self.address, client_id=client_id, insecure=self.insecure, credentials=credentials,
                           token=self.token, model=self.model)


def _text(content: Any) -> str:
    """A chat message's text (a string, or a list of parts as the page may send it)."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(_text(part.get("text", "")) if isinstance(part, Mapping) else _text(part) for part in content)
    if isinstance(content, Mapping):
        return _text(content.get("text", ""))
    return ""


class ChatEngine:
    """Answers chat messages with a split causal LM whose trunk runs on a trunk server.

    Args:
        model: named LLM or local folder holding the weights and the tokenizer.
        connection: the trunk server.
        cuts: cut points; default: the ones the server serves (its Info), else the named model's.
        max_new_tokens: the most tokens one answer may have.
    """

    def __init__(self, model: str, connection: Connection, *, cuts: tuple[int, int] | None = None,
                 max_new_tokens: int = 256) -> None:
        from splitfed.models import llm
        from splitfed.models.partload import load_parts

        self.model = model
        self.connection = connection
        self.max_new_tokens = max_new_tokens
        probe = connection.client()
        try:
            served = tuple(probe.info().cuts)
        finally:
            probe.close()
        if cuts is not None and served and tuple(cuts) != served:
            raise ConfigError(f"the trunk server at {connection.address} serves cuts {served[0]},{served[1]}; pass "
                              f"--cuts {served[0]},{served[1]} (or leave --cuts out)")
        if cuts is None and served:
            cuts = (served[0], served[1])
        elif cuts is None and model in llm.NAMED_LLMS:
            cuts = llm.NAMED_LLMS[model].default_cuts
        elif cuts is None:
            raise ConfigError(f"the trunk server at {connection.address} does not say its cuts; pass --cuts A,B")
        self.cuts = (int(cuts[0]), int(cuts[1]))
        parts = load_parts(model, self.cuts, ("bottom", "top"))
        self.bottom, self.top = parts.bottom.eval(), parts.top.eval()
        self.tokenizer = llm.load_tokenizer(model)
        config = llm.load_config(model)
        eos = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        config_eos = getattr(config, "eos_token_id", None)
        eos |= set(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
        self.eos = sorted(eos)
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()

    # -- prompts ------------------------------------------------------------------------------------
    def prompt_ids(self, history: Sequence[Mapping[str, Any]], message: str) -> torch.Tensor:
        """The token ids of the prompt for ``message`` after ``history`` (``{"role", "content"}`` dicts)."""
        if getattr(self.tokenizer, "chat_template", None):
            turns = [{"role": str(m["role"]), "content": _text(m.get("content"))} for m in history]
            text = self.tokenizer.apply_chat_template(turns + [{"role": "user", "content": message}],
                                                      tokenize=False, add_generation_prompt=True)
        else:
            text = message
        ids = self.tokenizer(text, return_tensors="pt").input_ids
        if ids.shape[1] == 0:
            raise ConfigError("the message is empty; type something")
        return ids

    # -- answers ------------------------------------------------------------------------------------
    def client(self, session: str) -> Any:
        """The trunk client of a browser session (made at its first message)."""
        with self._lock:
            client = self._clients.get(session)
            if client is None:
                client = self._clients[session] = self.connection.client(f"chat-{session[:24]}")
            return client

    def end(self, session: str) -> None:
        """A browser session ended: close its trunk client."""
        with self._lock:
            client = self._clients.pop(session, None)
        if client is not None:
            client.close()

    def stream(self, session: str, history: Sequence[Mapping[str, Any]], message: str, *,
               max_new_tokens: int | None = None, temperature: float = 0.0, seed: int | None = None
               ) -> Iterator[str]:
        """The answer to ``message``, yielded as its text so far each time a token adds to it.

        Greedy (``temperature`` 0) gives token for token what the unsplit model's ``generate(do_sample=False)``
        gives. Errors of the generation (the server's, as :class:`~splitfed.errors.ChannelError`) are raised here;
        when the caller stops reading, the generation stops at its next token and its server session is closed.
        """
        from splitfed.client.generation import RemoteSession, generate

        ids = self.prompt_ids(history, message)
        new = min(int(max_new_tokens or self.max_new_tokens), self.max_new_tokens)
        if new < 1:
            raise ConfigError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        client = self.client(session)
        tokens: queue.Queue[Any] = queue.Queue()
        done, stop = object(), threading.Event()

        def streamer(step: torch.Tensor) -> None:
            if stop.is_set():
                raise AnswerCancelled("the page stopped reading this answer")
            tokens.put(int(step[0]))

        def run() -> None:
            try:
                with RemoteSession(client, ids.shape[1] + new) as trunk:
                    generate(self.bottom, trunk, self.top, ids, max_new_tokens=new, temperature=temperature,
                             eos_token_id=self.eos, streamer=streamer, seed=seed)
                tokens.put(done)
            except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
                tokens.put(exc)

        worker = threading.Thread(target=run, name="splitfed-chat-answer", daemon=True)
        worker.start()
        answer: list[int] = []
        text = ""
        try:
            while True:
                item = tokens.get()
                if item is done:
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, AnswerCancelled):
                        return
                    raise item
                answer.append(item)
                decoded = self.tokenizer.decode(answer, skip_special_tokens=True)
                if decoded.endswith("\ufffd") or decoded == text:  # half a UTF-8 character, or nothing visible
                    continue
                text = decoded
                yield text
        finally:
            stop.set()

    def close(self) -> None:
        """Close every session's trunk client."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
