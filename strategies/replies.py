"""A round's replies: which clients failed, why, and whether enough succeeded to go on."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message

#: Flower wraps a ClientApp's exception as ``<class '...'>:<'...Message: TEXT'>``.
_WRAPPED = re.compile(r"^<class '[^']*'>:<'(?P<inner>.*)'>$", re.S)
_MESSAGE = re.compile(r"Exception \w+ occurred\. Message: (?P<text>.*)$", re.S)
#: What the ClientApp prefixes to a failure it reports (see ``apps.client_app``).
_CLIENT_PREFIX = "ClientFailedError: "


def merge_records(*outcomes: RoundReplies | None) -> dict[str, Any]:
    """One round's failures for the history: each stage's counts, and ``first-error`` (train's first)."""
    out: dict[str, Any] = {}
    for outcome in outcomes:
        if outcome is not None:
            out.update(outcome.record())
    first = next((o.errors[0] for o in outcomes if o is not None and o.errors), None)
    if first is not None:
        out["first-error"] = first
    return out


def failure_reason(reply: Message) -> str:
    """The client's own error text of an error reply, without Flower's wrapping."""
    reason = str(reply.error.reason).strip()
    match = _WRAPPED.match(reason)
    if match:
        reason = match.group("inner").strip()
    match = _MESSAGE.search(reason)
    if match:
        reason = match.group("text").strip()
    if reason.startswith(_CLIENT_PREFIX):
        reason = reason[len(_CLIENT_PREFIX):]
    return reason


@dataclass
class RoundReplies:
    """The outcome of one train or evaluate round: successful replies and failures."""

    stage: str  # "train" or "evaluate"
    sent: int
    ok: list[Message] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one per failed or missing reply

    @classmethod
    def sort(cls, stage: str, sent: int, replies: Iterable[Message]) -> RoundReplies:
        """Split ``replies`` into successes and failures; replies that never came count as failures."""
        out = cls(stage, sent)
        for reply in replies:
            if reply.has_error():
                out.errors.append(f"node {reply.metadata.src_node_id}: {failure_reason(reply)}")
            else:
                out.ok.append(reply)
        missing = sent - len(out.ok) - len(out.errors)
        if missing > 0:
            out.errors += [f"no reply from {missing} node(s) before the round's timeout"] * missing
        return out

    @property
    def failed(self) -> int:
        """How many clients failed (error replies and missing replies)."""
        return len(self.errors)

    def needed(self, min_nodes: int, accept_failures: float) -> int:
        """Successes the round needs: ``min_nodes`` and no more than ``accept_failures`` of those sent failing."""
        return max(min_nodes, math.ceil(self.sent * (1.0 - accept_failures) - 1e-9))

    def record(self) -> dict[str, Any]:
        """What the history keeps: counts and the first error."""
        out: dict[str, Any] = {self.stage: self.failed, f"{self.stage}-sent": self.sent}
        if self.errors:
            out[f"{self.stage}-first-error"] = self.errors[0]
        return out
