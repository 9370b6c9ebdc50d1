"""A trunk server with compiled blocks (``TrunkServer(..., compile=True)``, ``splitfed serve --compile``): it trains
as the eager server does, compiles before its first client (no call waits for a compile), keeps plain
state-dict keys, and runs inference sessions eagerly.

In CI the blocks compile with the ``aot_eager`` backend (dynamo and AOTAutograd trace them exactly as with the
default backend, without inductor's code generation, which takes minutes on 2 cores); then the compiled server
matches the eager one to float rounding. The slow test compiles with inductor.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
import torch
from conftest import tiny_model

from splitfed.channel.client.trunk import TrunkClient
from splitfed.split import CutState, split_model
from splitfed.trunk.aggregation.modes import make_aggregator

CLIENTS = 3
STEPS = 2


def _train(trunk_server: Any, compile: bool, graphs: Any = None) -> tuple[dict, Any, int, int]:
    """Three clients, two batched sync steps each: every client's outputs and input gradients, the trunk, and
    dynamo's graph count once the server started and once training ended."""
    split = split_model(tiny_model("gpt2").train(), cuts=(1, 3))
    server = trunk_server(split.trunk, lr=0.1, aggregator=make_aggregator("sync", timeout=60), batch_window_ms=500,
                          compile=compile)
    started = graphs() if graphs else 0
    outs: dict = {}
    barrier = threading.Barrier(CLIENTS)

    def client(i: int) -> None:
        c = TrunkClient(server.address, insecure=True, client_id=f"c{i}")
        c.join()
        for step in range(STEPS):
            g = torch.Generator().manual_seed(10 * step + i)
            state = CutState(torch.randn(2, 6 + i, 32, generator=g))
            barrier.wait(60)
            act = uuid.uuid4().hex
            out, _ = c.forward(state, activation_id=act, train=True, num_examples=2)
            reply = c.backward(act, torch.sin(out * (1 + i)))
            outs[(i, step)] = (out, reply.grad, reply.outcome)
        c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(outs) == CLIENTS * STEPS
    return outs, server, started, graphs() if graphs else 0


def _same_training(trunk_server: Any, graphs: Any, tolerance: float) -> None:
    eager, eager_server, _, _ = _train(trunk_server, compile=False)
    outs, server, started, ended = _train(trunk_server, compile=True, graphs=graphs)
    assert server.runtime.compiled and not eager_server.runtime.compiled
    assert started >= 2  # the training and the evaluation graphs, compiled before the first client came
    assert ended == started  # no call waited for a compile: one dynamic graph served every batch
    assert server.scheduler.stats["forward-batches"] >= 1  # the clients' forwards were batched
    for key, (out, grad, outcome) in eager.items():
        c_out, c_grad, c_outcome = outs[key]
        assert outcome == c_outcome == "APPLIED"
        torch.testing.assert_close(c_out, out, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(c_grad, grad, atol=tolerance, rtol=tolerance)
    trunk, eager_trunk = server.runtime.trunk.state_dict(), eager_server.runtime.trunk.state_dict()
    assert list(trunk) == list(eager_trunk)  # compiled in place: plain keys for checkpoints and exports
    assert not any("_orig_mod" in k for k in trunk)
    for name, value in eager_trunk.items():
        torch.testing.assert_close(trunk[name], value, atol=tolerance, rtol=tolerance)
    assert server.runtime.version == eager_server.runtime.version == STEPS


def test_a_compiled_trunk_trains_as_the_eager_one_and_compiles_before_its_first_client(
        trunk_server: Any, graphs: Any, aot_eager: None) -> None:
    _same_training(trunk_server, graphs, tolerance=1e-6)


def test_forwards_on_older_weights_compile_before_the_first_client(graphs: Any, aot_eager: None) -> None:
    """Async, three clients, three rounds: forwards on their version's copy of the weights and forwards rebased
    and recomputed on a frozen copy run the variant compiled when the runtime was built (nothing compiles after),
    and train as the eager runtime does."""
    from splitfed.trunk.compute.runtime import TrunkRuntime

    results = {}
    for compile in (False, True):
        torch.manual_seed(0)
        trunk = split_model(tiny_model("gpt2").train(), cuts=(1, 3)).trunk
        rt = TrunkRuntime(trunk, torch.optim.SGD(trunk.parameters(), lr=0.1),
                          aggregator=make_aggregator("async", max_staleness=8), compile=compile)
        started, seen = graphs(), []
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            outs = {c: rt.forward(c, f"{c}-{step}", CutState(torch.randn(2, 6, 32, generator=g)), train=True)[0]
                    for c in ("a", "b", "c")}
            for c in ("c", "b", "a"):  # each backward steps the trunk under the others' forwards
                seen += [outs[c], rt.backward(c, f"{c}-{step}", torch.sin(outs[c]) / 50).grad_in]
        results[compile] = (seen, trunk.state_dict(), graphs() - started)
        assert rt.stats["recomputed"] >= 1 and rt._copies.made >= 2 and rt.version == 9
    (eager, eager_weights, _), (compiled, weights, compiled_after) = results[False], results[True]
    assert compiled_after == 0
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6)
    for name, value in eager_weights.items():
        torch.testing.assert_close(weights[name], value, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_a_trunk_compiled_by_inductor_trains_as_the_eager_one(trunk_server: Any, graphs: Any) -> None:
    _same_training(trunk_server, graphs, tolerance=1e-4)


def test_a_compiled_trunk_decodes_eagerly(graphs: Any, aot_eager: None) -> None:
    """Decoding steps over a growing KV cache would recompile for every length: they run the blocks eagerly. (The
    runtime is made as ``splitfed serve`` makes it, so this also shows ``compile`` reaching it from a spec.)"""
    from splitfed.serving.build import make_runtime
    from splitfed.trunk.inference.sessions import SessionManager

    split = split_model(tiny_model("gpt2"), cuts=(1, 3))
    runtime = make_runtime(split.trunk, compile=True)
    compiled = graphs()
    sessions = SessionManager(runtime)
    session = sessions.open("c0", max_length=16)[0]
    for length in (5, 1, 1, 1):
        sessions.step("c0", session, CutState(torch.randn(1, length, 32)))
    assert runtime.compiled and graphs() == compiled


def test_compile_reaches_the_runtime_from_the_cli_the_admin_api_and_a_spec(aot_eager: None) -> None:
    """``splitfed serve --compile``, ``splitfed models load --compile`` and the admin API's ``compile`` field all
    end in a runtime whose blocks are compiled."""
    from splitfed.channel.server.admin import spec_from_proto, spec_to_proto
    from splitfed.cli.main import build_parser
    from splitfed.cli.models import spec_from_flag
    from splitfed.errors import ConfigError
    from splitfed.serving.spec import ModelSpec

    parser = build_parser()
    serve = parser.parse_args(["serve", "--model", "mnist-cnn", "--insecure", "--compile"])
    assert serve.compile and spec_from_flag("mnist-cnn", serve).compile
    assert not spec_from_flag("mnist-cnn", parser.parse_args(["serve", "--model", "mnist-cnn"])).compile
    load = parser.parse_args(["models", "load", "--server", "127.0.0.1:1", "gpt2", "--compile"])
    assert load.compile
    spec = ModelSpec(model="gpt2", compile=True)
    assert spec_from_proto(spec_to_proto(spec)).compile
    assert ModelSpec.from_mapping({"model": "gpt2", "compile": True}).compile  # a models file's key
    with pytest.raises(ConfigError, match="compile of model"):
        ModelSpec(model="gpt2", compile="yes")
    assert not spec_from_proto(spec_to_proto(ModelSpec(model="gpt2"))).compile
    # make_runtime(trunk, compile=True) gives a compiled runtime: test_a_compiled_trunk_decodes_eagerly builds its
    # runtime so (the blocks' compile takes seconds; one test pays it)
