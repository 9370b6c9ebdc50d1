"""The trunk runtime's batched forwards and the one backward of each batch (see :mod:`splitfed.trunk.compute.batching`).

Runs under the runtime's lock, on its trunk, with its store and aggregator: it
is a part of :class:`~splitfed.trunk.compute.runtime.TrunkRuntime` kept in its own
module.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from splitfed.errors import DuplicateActivationError, TensorValueError, TrunkStepError
from splitfed.trunk.compute.batching import ForwardGroup, batch_key, pack
from splitfed.trunk.device.early import chunk, nonfinite
from splitfed.trunk.compute.recompute import busy_on_oom, rerun
from splitfed.trunk.compute.store import DoneBackward, SavedForward
from splitfed.trunk.timeline import TIMELINE

if TYPE_CHECKING:
    from splitfed.trunk.compute.requests import ForwardRequest, PendingBackward
    from splitfed.trunk.compute.runtime import TrunkRuntime

log = logging.getLogger(__name__)

Outcome = tuple[torch.Tensor, int] | BaseException

#: Modes whose training forwards may share a trunk call: there the step applies a sum of gradients, so one
#: backward per batch gives it the same sum. In async mode each gradient is a step of its own.
BATCHED_TRAINING_MODES = ("sync", "quorum")


class Batcher:
    """Batched forwards of one runtime, and the groups of batched training forwards awaiting gradients."""

    def __init__(self, runtime: TrunkRuntime) -> None:
        self.rt = runtime
        self.groups: list[ForwardGroup] = []
        self.stats: dict[str, int] = {"batched-calls": 0, "batched-forwards": 0, "group-backwards": 0,
                                      "early-gradient-brings": 0}

    # -- forwards -------------------------------------------------------------------------------------
    def can_batch(self, request: ForwardRequest) -> bool:
        """Whether ``request`` may share a trunk call (see :meth:`TrunkRuntime.can_batch`)."""
        if request.retry or batch_key(request.state) is None:
            return False
        rt = self.rt
        return not request.train or (rt.trains and rt.aggregator.mode in BATCHED_TRAINING_MODES
                                     and not rt.checkpointing)

    def forward_many(self, requests: list[ForwardRequest]) -> list[Outcome]:
        """Run compatible requests together, the rest one by one; results in request order."""
        out: list[Outcome | None] = [None] * len(requests)
        buckets: dict[Any, list[int]] = defaultdict(list)
        for i, r in enumerate(requests):
            if self.can_batch(r):
                buckets[(r.train, batch_key(r.state))].append(i)
            else:
                out[i] = self._single(r)
        for indices in buckets.values():
            if len(indices) == 1:
                out[indices[0]] = self._single(requests[indices[0]])
                continue
            for i, result in zip(indices, self._batch([requests[i] for i in indices])):
                out[i] = result
        return out  # type: ignore[return-value]

    def _single(self, request: ForwardRequest) -> Outcome:
        try:
            return self.rt.forward_request(request)
        except Exception as exc:  # noqa: BLE001 - each caller gets its own error
            return exc

    def _batch(self, requests: list[ForwardRequest]) -> list[Outcome]:
        rt = self.rt
        out: list[Outcome | None] = [None] * len(requests)
        train = requests[0].train
        with rt._lock:
            requests, bad = rt.bring_requests(requests)
            ok: list[int] = []
            for i, r in enumerate(requests):
                try:
                    if i in bad:
                        raise nonfinite(bad[i])
                    if train:
                        if rt.store.find(r.activation_id) is not None or rt.store.done(r.activation_id) is not None \
                                or any(requests[j].activation_id == r.activation_id for j in ok):
                            raise DuplicateActivationError(f"activation id {r.activation_id!r} is already in use; "
                                                           "use a fresh id per forward")
                        rt.store.admit(r.client_id, 2 * r.state.hidden.numel() * r.state.hidden.element_size())
                    rt.check_input(r.state)  # the same checks as alone (shape, dtype)
                    ok.append(i)
                except Exception as exc:  # noqa: BLE001 - that request's own error
                    out[i] = exc
            if len(ok) >= 2:
                chosen = [requests[i] for i in ok]
                packed = pack([r.state for r in chosen])
                try:
                    results = self._run(chosen, packed) if train else self._evaluate(chosen, packed)
                except Exception as exc:  # noqa: BLE001 - every request of the batch gets it
                    results = [exc] * len(chosen)
                for i, result in zip(ok, results):
                    out[i] = result
        if len(ok) < 2:
            for i in ok:
                out[i] = self._single(requests[i])
            return out  # type: ignore[return-value]
        if train:
            for r, result in zip(chosen, results):
                if not isinstance(result, BaseException):
                    rt.aggregator.join(r.client_id)  # outside the runtime lock, as alone
        return out  # type: ignore[return-value]

    def _count(self, n: int) -> None:
        self.rt.stats["forwards"] += n
        self.stats["batched-calls"] += 1
        self.stats["batched-forwards"] += n

    def _evaluate(self, requests: list[ForwardRequest], packed: Any) -> list[Outcome]:
        rt = self.rt
        inputs, _ = rt._prepare(packed.state, train=False)
        with torch.no_grad(), rt._autocast(), busy_on_oom("forward"):
            out = rt.trunk(inputs).hidden
        self._count(len(packed.rows))
        parts = rt.deliver([(packed.part(out, i), r.reply) for i, r in enumerate(requests)])
        return [(part, rt.version) for part in parts]

    def _run(self, requests: list[ForwardRequest], packed: Any) -> list[Outcome]:
        rt = self.rt
        with TIMELINE.gpu("forward", n=len(requests)):
            inputs, leaf = rt._prepare(packed.state, train=True)
            assert leaf is not None
            output, nbytes, rng = rt.traced_forward(inputs)
        out_value = output.detach()
        rt.store.admit(requests[0].client_id, nbytes)
        self._count(len(requests))
        group = ForwardGroup(packed, leaf, output, rt.version, [r.client_id for r in requests],
                             [r.activation_id for r in requests], [max(int(r.num_examples), 1) for r in requests],
                             inputs=inputs.with_hidden(leaf), rng=rng)
        self.groups.append(group)
        rows = out_value.shape[0]
        for i, r in enumerate(requests):
            share = packed.rows[i].stop - packed.rows[i].start
            rt.store.add(SavedForward(r.activation_id, r.client_id, rt.version, r.state, None,
                                      packed.part(out_value, i), nbytes * share // rows, group.num_examples[i], rng,
                                      group=group, index=i))
        parts = rt.deliver([(packed.part(out_value, i), r.reply) for i, r in enumerate(requests)])
        return [(part, rt.version) for part in parts]

    # -- the batch's backward ---------------------------------------------------------------------------
    def receive(self, entry: SavedForward, grad: torch.Tensor, arrivals: tuple[Any, ...] = (), reply: Any = None
                ) -> tuple[PendingBackward, ForwardGroup | None]:
        """A member's gradient (its saved forward already taken from the store, runtime lock held).

        Returns its pending answer, and its group when that is now complete:
        the caller then calls :meth:`finish` outside the runtime lock. ``arrivals``: the gradient is on its
        way to the device (:class:`~splitfed.trunk.device.transfers.Arrival`); it is checked for NaN/Inf with the other
        members' at :meth:`finish` (one read of the device for the whole batch).
        """
        from splitfed.trunk.compute.requests import PendingBackward

        group: ForwardGroup = entry.group
        group.replies[entry.index] = reply
        if arrivals:
            group.arrivals[entry.index] = arrivals
            group.grads[entry.index] = grad
        else:
            group.grads[entry.index] = grad.to(self.rt.device, entry.out_value.dtype)
        pending = PendingBackward(group.grad_in[entry.index], group.result)
        hidden = entry.inputs.hidden
        self.rt.store.remember(entry.activation_id, DoneBackward(entry.client_id, pending.grad_in, pending.result,
                                                                 hidden.numel() * hidden.element_size()))
        return pending, group if group.complete else None

    def bring_due(self, group: ForwardGroup) -> bool:
        """Whether enough gradients of a batch still open wait in host memory to bring them before the others come
        (:mod:`splitfed.trunk.device.early`); if so, the batch is marked so that one such bring is asked for at a time."""
        with self.rt._lock:
            if not self.rt.bring_early or group.bringing or group.complete or group not in self.groups \
                    or len(group.arrivals) < chunk(len(group.clients)):
                return False
            group.bringing = True
            return True

    def bring_gradients(self, group: ForwardGroup) -> None:
        """Bring the gradients of a batch still open that wait in host memory (on the device thread, while the
        batch's other members' gradients come): at :meth:`finish` only the rest are left to bring. A member whose
        gradient holds NaN or Inf is refused and leaves the step, as there."""
        rt = self.rt
        with rt._lock:
            group.bringing = False
            if group not in self.groups or not group.arrivals:
                return
            taken = dict(group.arrivals)
            group.arrivals.clear()
        assert rt.io is not None
        try:
            with TIMELINE.host("bring-early", n=len(taken)):
                verdicts = self._verdicts(taken, rt.io.bring([a for i in sorted(taken) for a in taken[i]]))
        except Exception:
            with rt._lock:  # left to the batch's backward, which brings them again or answers every member
                group.arrivals.update(taken)
            raise
        with rt._lock:
            refused = self._settle_arrivals(group, taken, verdicts)
        self.stats["early-gradient-brings"] += 1
        for client in refused:
            rt.aggregator.leave(client)

    def awaiting(self) -> set[str]:
        """Clients whose gradient waits in a batch for the batch's backward."""
        return {g.clients[i] for g in list(self.groups) for i in list(g.grads)}

    def poll(self) -> None:
        """Members dropped from the step group will not send their gradient: run their batches without them."""
        members = self.rt.aggregator.members
        ready = []
        with self.rt._lock:
            for group in list(self.groups):
                for i, client in enumerate(group.clients):
                    if i not in group.grads and i not in group.dropped and client not in members:
                        group.dropped.add(i)
                        if self.rt.store.find(group.activation_ids[i]) is not None:
                            self.rt.store.pop(group.activation_ids[i])
                if group.complete:
                    ready.append(group)
                elif len(group.dropped) == len(group.clients):
                    self.groups.remove(group)
        for group in ready:
            self.finish(group)

    def rebase(self, frozen: list[torch.Tensor]) -> int:
        """The trunk is about to step: batches still waiting for gradients keep the weights they saw
        (``frozen``, copied before the step) and their backward recomputes the batched forward on them, with
        its RNG state, so each member's gradient is exactly that of the version it saw. Returns how many."""
        rebased = 0
        for group in self.groups:
            if group.frozen is None:
                group.frozen, group.output = frozen, None
                rebased += 1
        return rebased

    def _output(self, group: ForwardGroup) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The batch's output with its graph, and the weights it depends on (recomputed when rebased)."""
        rt = self.rt
        if group.frozen is None:
            assert group.output is not None
            return group.output, rt._trainable
        rt.stats["recomputed"] += 1
        output = rerun(rt.trunk, rt._names, group.inputs, group.rng, group.frozen, rt._autocast())
        return output, list(group.frozen)

    def finish(self, group: ForwardGroup) -> None:
        """One backward for the whole batch; the trunk's gradient goes to the aggregator as one contribution.

        Call without the runtime lock (the aggregator may step the trunk)."""
        rt = self.rt
        with rt._lock:
            if group not in self.groups:  # finished or abandoned meanwhile
                return
            refused = self._check_arrivals(group)
            if not group.grads:
                self.groups.remove(group)
                for client in refused:
                    rt.aggregator.leave(client)
                return
            self.groups.remove(group)
            members = tuple(group.clients[i] for i in sorted(group.grads))
            try:
                with TIMELINE.gpu("backward", n=len(group.grads)):
                    group.output, weights_seen = self._output(group)
                    full, weights, total = group.output_gradient()
                    targets = [group.leaf] + (weights_seen if rt.trains else [])
                    grads = torch.autograd.grad(group.output, targets, full, allow_unused=True)
            except RuntimeError as exc:
                error = TrunkStepError(f"the batched backward of {len(members)} clients failed on the server: "
                                       f"{exc}; run the forward again")
                for i in group.grads:
                    group.grad_in[i].set_exception(error)
                group.result.set_exception(error)
                return
            finally:
                group.output = None  # the graph is spent either way
            self.stats["group-backwards"] += 1
            rt.stats["backwards"] += len(members)
            grad_leaf = grads[0] if grads[0] is not None else torch.zeros_like(group.leaf)
            members_in = sorted(group.grads)
            with TIMELINE.host("grads-out", n=len(members_in)):
                parts = rt.deliver([(group.packed.part(grad_leaf, i) / weights[i], group.replies.get(i))
                                    for i in members_in])
            for i, part in zip(members_in, parts):
                group.grad_in[i].set_result(part)
        for client in refused:  # the step does not wait for them (as for a gradient refused on arrival)
            rt.aggregator.leave(client)
        result = rt._submit(members[0], group.version, list(grads[1:]), total, members=members)
        result.add_done_callback(lambda f, target=group.result: _copy(f, target))

    def finish_or_fail(self, group: ForwardGroup) -> None:
        """:meth:`finish`, and should it fail unexpectedly, every member still waiting gets the error (a client is
        never left waiting for an answer that will not come)."""
        try:
            self.finish(group)
        except Exception as exc:
            error = TrunkStepError(f"the batched backward of {len(group.clients)} clients failed on the server: "
                                   f"{exc!r}; run the forward again")
            for future in [*group.grad_in, group.result]:
                if not future.done():
                    future.set_exception(error)
            raise

    def _check_arrivals(self, group: ForwardGroup) -> list[str]:
        """Bring the members' gradients still in host memory (one call for the batch): a member whose gradient
        holds NaN or Inf is refused (INVALID_ARGUMENT) and dropped from the batch. Returns the refused members."""
        if not group.arrivals:
            return []
        io = self.rt.io
        assert io is not None
        taken = dict(group.arrivals)
        group.arrivals.clear()
        return self._settle_arrivals(group, taken,
                                     self._verdicts(taken, io.bring([a for i in sorted(taken) for a in taken[i]])))

    @staticmethod
    def _verdicts(taken: dict[int, tuple[Any, ...]], brought: list[bool]) -> dict[int, bool]:
        """Per member (in the order of its index), whether every tensor it sent was free of NaN and Inf."""
        verdicts = iter(brought)
        return {i: all([next(verdicts) for _ in taken[i]]) for i in sorted(taken)}

    @staticmethod
    def _settle_arrivals(group: ForwardGroup, taken: dict[int, tuple[Any, ...]], verdicts: dict[int, bool]
                         ) -> list[str]:
        """The brought gradients become the members' (runtime lock held); a member whose gradient held NaN or Inf
        is refused (INVALID_ARGUMENT) and dropped from the batch. Returns the refused members."""
        refused = []
        for i, ok in verdicts.items():
            if ok:
                group.grads[i] = taken[i][0].tensor
                continue
            del group.grads[i]
            group.dropped.add(i)
            group.grad_in[i].set_exception(TensorValueError(
                f"the gradient of {group.activation_ids[i]} holds NaN or Inf values; the sender must stop or lower "
                "its learning rate before sending again"))
            refused.append(group.clients[i])
        return refused


def _copy(source: Future[Any], target: Future[Any]) -> None:
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())
