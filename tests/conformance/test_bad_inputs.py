"""The hostile-input catalogue (docs/bad_inputs.md) over every transport: each malformed or hostile request gets
its precise status (never UNKNOWN or INTERNAL) whichever way it came, and the server keeps serving with nothing lost:
SERVING on health, the trunk's weights and version unchanged, and a well-formed step over the same transport
applies."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from splitfed.channel.security.tokens import TokenIssuer
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.wire.retry import RetryPolicy
from splitfed.errors import ChannelError
from splitfed.split import CutState

from .conftest import Conn
from .transports import HIDDEN, ROWS, TOKENS, Transport, hidden, serving, snapshot, tensor, unchanged


@dataclass(frozen=True)
class Case:
    """A bad request: its catalogue id, the status it gets, a fragment of the message, and what sends it
    (``send(method, header, encs)`` over the transport under test; ``conn`` for the set-up)."""

    id: str
    code: str | dict[str, str]
    fragment: str | dict[str, str]
    action: Callable[[Conn, Callable[..., object]], object]
    #: Over a bulk link the request breaks the link's own protocol (its transfer's size disagrees with its header, or
    #: passes the largest tensor the link takes): the server closes that link, the call is retried over gRPC and refused there, and the client streams over
    #: gRPC from then on. Sent by a client of its own, so the test's client keeps its link.
    breaks_link: bool = False

    def expected(self, carriage: str) -> tuple[str, str]:
        """The status and message fragment for a request carried ``carriage``'s way."""
        code = self.code if isinstance(self.code, str) else self.code[carriage]
        return code, self.fragment if isinstance(self.fragment, str) else self.fragment[carriage]


def _fwd(act: str | None = None, train: bool = True) -> pb.ForwardRequest:
    return pb.ForwardRequest(activation_id=uuid.uuid4().hex if act is None else act, train=train, num_examples=ROWS)


def _forward(*encs):
    return lambda conn, send: send("Forward", _fwd(), list(encs))


def _saved(conn: Conn) -> str:
    """A training forward over the transport, its backward pending; returns its activation id."""
    act = uuid.uuid4().hex
    conn.client.forward(CutState(hidden().to(conn.transport.device)), activation_id=act)
    return act


def _backward_with(grad: torch.Tensor):
    def run(conn, send):
        act = _saved(conn)
        send("Backward", pb.BackwardRequest(activation_id=act), [tensor("grad", grad)])
    return run


def _duplicate(conn, send):
    act = _saved(conn)
    send("Forward", _fwd(act), [tensor("hidden", hidden())])


def _twice(conn, send):
    act = _saved(conn)
    conn.client.backward(act, torch.zeros(ROWS, TOKENS, HIDDEN, device=conn.transport.device))
    conn.snap = snapshot(conn.server)  # the first backward legitimately stepped the trunk
    send("Backward", pb.BackwardRequest(activation_id=act), [tensor("grad", torch.zeros(ROWS, TOKENS, HIDDEN))])


def _after_eval(conn, send):
    act = uuid.uuid4().hex
    conn.client.forward(CutState(hidden().to(conn.transport.device)), activation_id=act, train=False)
    send("Backward", pb.BackwardRequest(activation_id=act), [tensor("grad", torch.zeros(ROWS, TOKENS, HIDDEN))])


def _foreign(conn, send):
    other = conn.transport.open_client(conn.server, client_id="mallory")
    try:
        act = uuid.uuid4().hex
        other.forward(CutState(hidden().to(conn.transport.device)), activation_id=act)
        send("Backward", pb.BackwardRequest(activation_id=act), [tensor("grad", torch.zeros(ROWS, TOKENS, HIDDEN))])
    finally:
        other.close()


H = hidden
CASES: list[Case] = [
    Case("unknown-dtype", "INVALID_ARGUMENT", "dtype", _forward(tensor("hidden", H(), dtype=42))),
    Case("unspecified-dtype", "INVALID_ARGUMENT", "dtype", _forward(tensor("hidden", H(), dtype=0))),
    Case("int-hidden", "INVALID_ARGUMENT", "hidden",
         _forward(tensor("hidden", torch.ones(ROWS, TOKENS, HIDDEN, dtype=torch.int32)))),
    Case("bytes-vs-shape", "INVALID_ARGUMENT",
         {"unary": "declares shape [2, 5, 33] of FLOAT32 (1320 bytes) but carries 1280 bytes",
          "region": "needs 1320 bytes but names a slice of 1280", "stream": "received 1280 of 1320 declared bytes"}, _forward(tensor("hidden", H(), shape=(ROWS, TOKENS, HIDDEN + 1))),
         breaks_link=True),
    Case("negative-dim", "INVALID_ARGUMENT", "negative", _forward(tensor("hidden", H(), shape=(-ROWS, TOKENS, HIDDEN)))),
    # A declared size past the server's largest tensor: refused before a byte is allocated. Inline it is a malformed
    # message (the catalogue's huge-declared-unary), streamed a request too large (huge-declared-stream), in a region
    # a shape its slice does not hold.
    Case("huge-declared", {"unary": "INVALID_ARGUMENT", "region": "INVALID_ARGUMENT", "stream": "RESOURCE_EXHAUSTED"},
         {"unary": "above the limit", "region": "names a slice of 1280", "stream": "above the limit"},
         _forward(tensor("hidden", H(), shape=(1 << 30, TOKENS, HIDDEN)))),
    # A tensor whose bytes really are past the server's largest tensor (256 KiB against 128 KiB).
    Case("oversize", {"unary": "INVALID_ARGUMENT", "region": "RESOURCE_EXHAUSTED", "stream": "RESOURCE_EXHAUSTED"},
         "262144 bytes, above the limit of 131072", _forward(tensor("hidden", H(8, 256))), breaks_link=True),
    Case("empty-tensor", "INVALID_ARGUMENT", "empty", _forward(tensor("hidden", H(0)))),
    Case("nan-hidden", "INVALID_ARGUMENT", "NaN",
         _forward(tensor("hidden", H().index_fill_(1, torch.tensor([2]), float("nan"))))),
    Case("inf-grad", "INVALID_ARGUMENT", "NaN or Inf",
         _backward_with(torch.full((ROWS, TOKENS, HIDDEN), float("inf")))),
    Case("no-hidden", "INVALID_ARGUMENT", "no 'hidden'",
         _forward(tensor("attention_mask", torch.ones(ROWS, TOKENS, dtype=torch.long)))),
    Case("unknown-tensor-name", "INVALID_ARGUMENT", "unexpected tensor",
         _forward(tensor("hidden", H()), tensor("labels", torch.ones(ROWS)))),
    Case("duplicate-tensor-name", "INVALID_ARGUMENT", "twice", _forward(tensor("hidden", H()), tensor("hidden", H()))),
    Case("mask-shape", "INVALID_ARGUMENT", "attention_mask",
         _forward(tensor("hidden", H()), tensor("attention_mask", torch.ones(ROWS + 1, TOKENS, dtype=torch.long)))),
    Case("wrong-hidden-size", "INVALID_ARGUMENT", "hidden must be", _forward(tensor("hidden", H(width=HIDDEN + 8)))),
    Case("empty-activation-id", "INVALID_ARGUMENT", "activation_id",
         lambda conn, send: send("Forward", _fwd(""), [tensor("hidden", H())])),
    Case("duplicate-activation-id", "ALREADY_EXISTS", "already in use", _duplicate),
    Case("backward-before-forward", "NOT_FOUND", "no saved forward",
         lambda conn, send: send("Backward", pb.BackwardRequest(activation_id="never-forwarded"),
                                 [tensor("grad", torch.zeros(ROWS, TOKENS, HIDDEN))])),
    Case("backward-twice", "FAILED_PRECONDITION", "already received", _twice),
    Case("backward-after-eval-forward", "NOT_FOUND", "no saved forward", _after_eval),
    Case("foreign-activation", "PERMISSION_DENIED", "another client", _foreign),
    Case("grad-shape-differs", "INVALID_ARGUMENT", "differs", _backward_with(torch.zeros(ROWS, TOKENS - 1, HIDDEN))),
    Case("unknown-session", "NOT_FOUND", "session",
         lambda conn, send: send("Forward", pb.ForwardRequest(activation_id="s", session_id="nope"),
                                 [tensor("hidden", H())])),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_a_precise_status_and_the_server_serves_on(conn: Conn, case: Case) -> None:
    t = conn.transport
    conn.snap = snapshot(conn.server)
    # Execute: the bad request, sent this transport's way.
    sender = t.open_client(conn.server, client_id="breaker", retry=RetryPolicy(initial_backoff_s=0.01)) \
        if case.breaks_link and t.carriage == "stream" else conn.client
    with pytest.raises(ChannelError) as info:
        case.action(conn, lambda method, header, encs: t.send(sender, method, header, encs))
    if sender is not conn.client:
        assert sender.bulk.failed is not None
        sender.close()
    # Assert: its status and message, health, nothing changed.
    code, fragment = case.expected(t.carriage)
    assert info.value.code == code and fragment in str(info.value), str(info.value)
    assert serving(conn.server)
    assert unchanged(conn.server, conn.snap)
    # Forwards left pending by the set-up are finished by their owner.
    for entry in conn.server.runtime.store.entries():
        if entry.client_id == "alice":
            conn.client.backward(entry.activation_id, torch.zeros_like(entry.out_value))
    # A well-formed step over the same transport still applies.
    version, went = conn.server.runtime.version, conn.went()
    act = _saved(conn)
    reply = conn.client.backward(act, torch.zeros(ROWS, TOKENS, HIDDEN, device=conn.transport.device))
    assert reply.outcome == "APPLIED" and conn.server.runtime.version == version + 1
    assert conn.went() == went + 2, f"the healthy step did not go over {t.name}"


def test_a_wrong_token_is_refused_whichever_way_the_call_would_go(transport: Transport) -> None:
    # Prepare: a server that requires tokens; a client with a valid one, one signed with another key, one with none.
    issuer = TokenIssuer("run-conformance")
    server = transport.open_server(authenticate=issuer.authenticate)
    good = transport.open_client(server, token=issuer.issue(1, 1))
    forged = transport.open_client(server, token=TokenIssuer("run-conformance").issue(1, 1))
    anonymous = transport.open_client(server)
    try:
        snap = snapshot(server)
        # Execute / Assert: the wrong tokens are refused before anything runs (the region or link they would open
        # is refused too, so the call itself goes over gRPC, and is refused there).
        for client in (forged, anonymous):
            with pytest.raises(ChannelError) as info:
                client.forward(CutState(hidden().to(transport.device)), activation_id=uuid.uuid4().hex)
            assert info.value.code == "UNAUTHENTICATED", str(info.value)
        assert unchanged(server, snap) and serving(server)
        act, went = uuid.uuid4().hex, transport.went(server, good)
        out, _ = good.forward(CutState(hidden().to(transport.device)), activation_id=act)
        assert good.backward(act, torch.zeros_like(out, device=transport.device)).outcome == "APPLIED"
        assert transport.went(server, good) == went + 2, f"the good client's calls did not go over {transport.name}"
    finally:
        for client in (good, forged, anonymous):
            client.close()
        server.stop(grace=0)
