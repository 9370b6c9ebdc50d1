"""Forward/backward exactness over every transport: SGD steps of the split model, its trunk served over the
transport, equal the same steps of the unsplit model, and every Forward and Backward took the transport."""

from __future__ import annotations

import copy

import torch
from conftest import batch_for

from splitfed.channel.client.remote import RemoteTrunk
from splitfed.split import SplitModel, split_model

from .transports import CUTS, Transport, model

STEPS = 3


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)


def test_split_steps_over_the_transport_equal_the_unsplit_model(transport: Transport) -> None:
    # Prepare: the unsplit model and its split twin, whose trunk a server of this transport holds. On the CPU the
    # two are bit for bit the same; a GPU may pick other kernels for the parts' shapes.
    tolerance = 0.0 if transport.device == "cpu" else 1e-6
    net = model().to(transport.device)
    ref = copy.deepcopy(net)
    split = split_model(net, CUTS)
    server = transport.open_server(split.trunk)
    remote = RemoteTrunk(transport.open_client(server))
    try:
        split_net = SplitModel(split.bottom, remote, split.top, task=split.task)
        opt = torch.optim.SGD(split.client_modules().parameters(), lr=0.05)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        ids, mask, labels = (t.to(transport.device) for t in batch_for("llama", batch=2, length=5, padded=True))
        # Execute: the same steps both ways (the server's SGD has the client's learning rate, 0.05).
        for _ in range(STEPS):
            loss = split_net(ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            want = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
            want.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            assert (loss.detach() - want.detach()).abs().item() <= tolerance
        # Assert: the same weights everywhere (the trunk's are the server's), every call over the transport.
        assert _max_diff(net, ref) <= tolerance
        assert server.runtime.version == STEPS
        assert transport.went(server, remote.client) == 2 * STEPS, f"the calls did not all go over {transport.name}"
    finally:
        remote.client.close()
        server.stop(grace=0)
