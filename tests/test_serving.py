"""One trunk server, several models: each call goes to the model it names, their states never mix, and models
load, unload (draining their calls) and reload while the others serve."""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from llm_fixtures import VOCAB, save_byte_tokenizer

from splitfed.channel.client.trunk import RetryPolicy, TrunkClient
from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.channel.server.units import ModelState, build_unit
from splitfed.errors import ChannelError
from splitfed.client.generation import RemoteSession, generate
from splitfed.serving.spec import ModelSpec
from splitfed.split import CutState, split_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models run fastest on one thread

CNN_INPUT = (2, 32, 14, 14)  # mnist-cnn's input at cut 3


def save_llama(folder: Path) -> Path:
    """A tiny Llama (SmolLM2's architecture) with weights spread wide enough that greedy decoding varies."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tiny_config("llama", 4)
    cfg.vocab_size = VOCAB
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 256, 257, 258
    model = tf.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(folder)
    save_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def two_models(llama_dir: Path):
    """A server holding the MNIST CNN ("cnn") and the tiny Llama with LoRA on its trunk ("llm")."""
    server = TrunkServer(models=[ModelSpec("mnist-cnn", name="cnn"),
                                 ModelSpec(str(llama_dir), name="llm", cuts=(1, 3), lora_rank=4)],
                         insecure=True).start()
    yield server
    server.stop(grace=0)


def _train_step(client: TrunkClient) -> str:
    act = uuid.uuid4().hex
    out, _ = client.forward(CutState(torch.randn(*CNN_INPUT)), activation_id=act, train=True)
    return client.backward(act, torch.ones_like(out)).outcome


def _reference(llama_dir: Path, ids: torch.Tensor, new: int) -> torch.Tensor:
    from splitfed.models.llm import load_model

    model = load_model(str(llama_dir)).eval()
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                          pad_token_id=258, eos_token_id=257)


def _generate(address: str, llama_dir: Path, ids: torch.Tensor, new: int) -> torch.Tensor:
    from splitfed.models.partload import load_parts

    parts = load_parts(str(llama_dir), (1, 3), ("bottom", "top"))
    with TrunkClient(address, insecure=True, model="llm") as client, \
            RemoteSession(client, ids.shape[1] + new) as session, torch.no_grad():
        return generate(parts.bottom.eval(), session, parts.top.eval(), ids, max_new_tokens=new,
                        eos_token_id=257, pad_token_id=258)


# -- two models at once ------------------------------------------------------------------------
def test_trains_one_model_and_generates_with_the_other_at_the_same_time(two_models, llama_dir: Path) -> None:
    server = two_models
    ids = torch.tensor([[72, 101, 108, 108, 111]])
    want = _reference(llama_dir, ids, 10)
    outcomes: list[str] = []
    steps_done: list[float] = []
    errors: list[Exception] = []
    generating, generated = threading.Event(), threading.Event()

    def train() -> None:  # trains until the generation is over (at least 3 steps)
        try:
            with TrunkClient(server.address, insecure=True, model="cnn") as client:
                while not generated.is_set() or len(outcomes) < 3:
                    outcomes.append(_train_step(client))
                    steps_done.append(time.monotonic())
                    generating.wait(30)
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    trainer = threading.Thread(target=train)
    trainer.start()
    while not steps_done and trainer.is_alive():
        time.sleep(0.01)
    generating.set()
    began = time.monotonic()
    got = _generate(server.address, llama_dir, ids, 10)
    ended = time.monotonic()
    generated.set()
    trainer.join(60)
    assert not errors and outcomes == ["APPLIED"] * len(outcomes)
    assert any(began < t < ended for t in steps_done)  # training steps finished while it generated
    assert torch.equal(got, want)  # LoRA's B starts at zero: the served trunk is the checkpoint's
    assert server.unit("cnn").runtime.version == len(outcomes)  # each model's own steps
    assert server.unit("llm").runtime.version == 0
    assert len(server.unit("llm").runtime.store) == 0 == len(server.unit("cnn").runtime.store)


def test_info_names_the_model_served(two_models) -> None:
    with TrunkClient(two_models.address, insecure=True, model="cnn") as cnn, \
            TrunkClient(two_models.address, insecure=True, model="llm") as llm:
        assert (cnn.info().model, list(cnn.info().cuts)) == ("cnn", [3, 6])
        assert (llm.info().model, list(llm.info().cuts)) == ("llm", [1, 3])


def test_state_of_two_models_never_mixes(llama_dir: Path) -> None:
    """The same checkpoint under two names: one trains, the other's weights and saved forwards are untouched,
    and an activation saved by one is unknown to the other."""
    server = TrunkServer(models=[ModelSpec(str(llama_dir), name="a", cuts=(1, 3), lora_rank=4, optimizer="adamw"),
                                 ModelSpec(str(llama_dir), name="b", cuts=(1, 3), lora_rank=4, optimizer="adamw")],
                         insecure=True).start()
    try:
        before = {k: v.clone() for k, v in server.unit("b").runtime.trunk.state_dict().items()}
        a, b = (TrunkClient(server.address, insecure=True, model=m, client_id="same") for m in ("a", "b"))
        hidden = CutState(torch.randn(1, 4, 32))
        for _ in range(3):
            act = uuid.uuid4().hex
            out, _ = a.forward(hidden, activation_id=act, train=True)
            assert a.backward(act, torch.randn_like(out)).outcome == "APPLIED"
        a.forward(hidden, activation_id="kept-by-a", train=True)
        with pytest.raises(ChannelError) as info:  # a's saved forward is not b's
            b.backward("kept-by-a", torch.ones(1, 4, 32))
        assert info.value.code == "NOT_FOUND"
        after = server.unit("b").runtime.trunk.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert server.unit("a").runtime.version == 3 and server.unit("b").runtime.version == 0
        assert server.unit("a").runtime.optimizer is not server.unit("b").runtime.optimizer
        assert len(server.unit("a").runtime.store) == 1 and len(server.unit("b").runtime.store) == 0
        a.close()
        b.close()
    finally:
        server.stop(grace=0)


# -- routing -------------------------------------------------------------------------------------
def test_a_call_naming_no_model_goes_to_the_only_one_and_is_refused_with_several(two_models) -> None:
    with TrunkClient(two_models.address, insecure=True) as client:
        with pytest.raises(ChannelError) as info:
            client.info()
        assert info.value.code == "INVALID_ARGUMENT" and "'cnn', 'llm'" in str(info.value)
        two_models.unload("llm")
        assert client.info().model == "cnn"  # one model left: calls that name none go to it
        assert _train_step(client) == "APPLIED"


def test_unknown_model_is_not_found_with_the_names_held_and_nothing_changes(two_models) -> None:
    with TrunkClient(two_models.address, insecure=True, model="nope") as client:
        for call in (client.info, client.join, lambda: _train_step(client),
                     lambda: client.open_session(max_length=8)):
            with pytest.raises(ChannelError) as info:
                call()
            assert info.value.code == "NOT_FOUND"
            assert "does not hold model 'nope'" in str(info.value) and "'cnn', 'llm'" in str(info.value)
    for name in ("cnn", "llm"):
        runtime = two_models.unit(name).runtime
        assert runtime.version == 0 and len(runtime.store) == 0 and not runtime.aggregator.members
    assert two_models.models() == {"cnn": ModelState.READY, "llm": ModelState.READY}


def test_models_a_starting_server_has_yet_to_load_are_loading_not_missing(llama_dir: Path, monkeypatch) -> None:
    from splitfed.channel.server import registry

    first_loads, go_on = threading.Event(), threading.Event()
    build = registry.unit_from_spec

    def slow_first(spec, *args):  # type: ignore[no-untyped-def]
        if spec.name == "llm":  # the first model loads until the test has called the other one
            first_loads.set()
            assert go_on.wait(60)
        return build(spec, *args)

    monkeypatch.setattr(registry, "unit_from_spec", slow_first)
    server = TrunkServer(models=[ModelSpec(str(llama_dir), name="llm", cuts=(1, 3)),
                                 ModelSpec("mnist-cnn", name="cnn")], insecure=True)
    starting = threading.Thread(target=server.start)
    starting.start()
    try:
        assert first_loads.wait(60)
        once = RetryPolicy(max_attempts=1)
        for model in ("cnn", "llm", ""):  # the one not loading yet, the one loading, and one named by none
            with TrunkClient(server.address, insecure=True, model=model, retry=once) as client:
                with pytest.raises(ChannelError) as info:
                    client.info()
            assert info.value.code == ("INVALID_ARGUMENT" if not model else "UNAVAILABLE"), model
            assert not model or f"model {model!r} is loading" in str(info.value)
        with TrunkClient(server.address, insecure=True, model="nope", retry=once) as client:
            with pytest.raises(ChannelError) as info:
                client.info()
            assert info.value.code == "NOT_FOUND"
        go_on.set()
        starting.join(120)
        with TrunkClient(server.address, insecure=True, model="cnn") as client:
            assert client.info().model == "cnn"
    finally:
        go_on.set()
        starting.join(120)
        server.stop(grace=0)


# -- lifecycle -----------------------------------------------------------------------------------
def test_unloading_one_leaves_the_other_serving_and_reloading_restores_it(two_models, llama_dir: Path) -> None:
    server = two_models
    ids = torch.tensor([[87, 104, 111]])
    want = _reference(llama_dir, ids, 6)
    with TrunkClient(server.address, insecure=True, model="cnn") as cnn:
        assert _train_step(cnn) == "APPLIED"
        runtime = weakref.ref(server.unit("cnn").runtime)
        server.unload("cnn")
        assert server.models() == {"llm": ModelState.READY}
        assert torch.equal(_generate(server.address, llama_dir, ids, 6), want)  # the other one serves on
        with pytest.raises(ChannelError) as info:
            _train_step(cnn)
        assert info.value.code == "NOT_FOUND" and "'llm'" in str(info.value)
        import gc

        gc.collect()
        assert runtime() is None  # nothing of the unloaded model is kept
        server.load(ModelSpec("mnist-cnn", name="cnn"))
        assert _train_step(cnn) == "APPLIED" and server.unit("cnn").runtime.version == 1  # fresh from its source
    with TrunkClient(server.address, insecure=True, model="llm") as llm:
        session, _ = llm.open_session(max_length=8)
        entry = server.reload("llm")
        assert entry.state is ModelState.READY and server.unit("llm").runtime.version == 0
        with pytest.raises(ChannelError) as info:  # the old session went with the old trunk
            llm.forward(CutState(torch.randn(1, 1, 32)), train=False, session_id=session)
        assert info.value.code == "NOT_FOUND"
    assert torch.equal(_generate(server.address, llama_dir, ids, 6), want)


def test_each_model_method_is_wrapped_once_and_a_reloaded_model_gets_its_own(two_models) -> None:
    """The dispatcher keeps its per-call wrapper of a method on the model's unit: made on the first call, reused,
    and gone with the unit (a reloaded model's calls never reach the runtime it replaced)."""
    from types import SimpleNamespace

    from splitfed.channel.server.dispatch import ModelDispatch
    from splitfed.channel.wire.limits import MODEL_KEY, SERVICE_NAME

    dispatch = ModelDispatch(two_models.registry.route)

    def handler(model: str, method: str = "Forward"):
        return dispatch.service(SimpleNamespace(method=f"/{SERVICE_NAME}/{method}",
                                                invocation_metadata=((MODEL_KEY, model),)))

    first = handler("cnn")
    assert first is not None and first.unary_unary is not None
    assert handler("cnn") is first
    assert handler("llm") is not first and handler("cnn", "Backward") is not first
    assert handler("cnn", "NoSuchMethod") is None
    assert set(two_models.unit("cnn").tracked) == {f"/{SERVICE_NAME}/Forward", f"/{SERVICE_NAME}/Backward"}
    two_models.reload("cnn")
    again = handler("cnn")
    assert again is not first and handler("cnn") is again
    with TrunkClient(two_models.address, insecure=True, model="cnn") as cnn:
        assert _train_step(cnn) == "APPLIED" and two_models.unit("cnn").runtime.version == 1


NO_RETRY = RetryPolicy(retryable_codes=("DATA_LOSS",))  # UNAVAILABLE is not retried: the test sees it
SLOW_INPUT = (10000, 4)  # above the size a forward may run inline on the event loop: it goes to the device thread


class SlowTrunk(torch.nn.Module):
    """A trunk whose forward takes ``delay`` seconds (a call in flight while the model is unloaded)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.delay = delay
        self.started = threading.Event()

    def forward(self, state: CutState) -> CutState:
        self.started.set()
        time.sleep(self.delay)
        return state.with_hidden(self.linear(state.hidden))


def _slow_server(delay: float) -> tuple[TrunkServer, SlowTrunk]:
    server = TrunkServer(models=[ModelSpec("mnist-cnn", name="cnn")], insecure=True).start()
    trunk = SlowTrunk(delay)
    unit = build_unit("slow", trunk, server.options).start()
    server._run(_add(server, unit))
    return server, trunk


async def _add(server: TrunkServer, unit) -> None:
    server.registry.add(unit)


def test_unload_lets_calls_in_flight_finish_and_refuses_new_ones() -> None:
    server, trunk = _slow_server(delay=1.5)
    try:
        client = TrunkClient(server.address, insecure=True, model="slow")
        results: dict[str, object] = {}

        def forward() -> None:
            results["out"] = client.forward(CutState(torch.randn(*SLOW_INPUT)), train=False)[0]

        call = threading.Thread(target=forward)
        call.start()
        assert trunk.started.wait(10)
        unloading = threading.Thread(target=lambda: results.setdefault("entry", server.unload("slow")))
        unloading.start()
        deadline = time.monotonic() + 5
        while server.models().get("slow") is not ModelState.UNLOADING and time.monotonic() < deadline:
            time.sleep(0.01)
        probe = TrunkClient(server.address, insecure=True, model="slow", retry=NO_RETRY)
        with pytest.raises(ChannelError) as info:  # a new call while it drains (not retried: it would find none)
            probe.forward(CutState(torch.randn(*SLOW_INPUT)), train=False)
        probe.close()
        assert info.value.code == "UNAVAILABLE" and "'slow' is being unloaded" in str(info.value)
        assert unloading.is_alive()  # it waits for the call in flight
        call.join(10)
        unloading.join(10)
        assert results["out"].shape == SLOW_INPUT  # the call in flight finished with its answer
        assert "slow" not in server.models() and server.models() == {"cnn": ModelState.READY}
        with TrunkClient(server.address, insecure=True, model="cnn") as cnn:
            assert _train_step(cnn) == "APPLIED"
        client.close()
    finally:
        server.stop(grace=0)


def test_a_call_past_the_drain_deadline_ends_unavailable() -> None:
    server, trunk = _slow_server(delay=3.0)
    try:
        client = TrunkClient(server.address, insecure=True, model="slow", retry=NO_RETRY)
        errors: list[ChannelError] = []
        ended: list[float] = []

        def forward() -> None:
            try:
                client.forward(CutState(torch.randn(*SLOW_INPUT)), train=False)
            except ChannelError as exc:
                errors.append(exc)
            ended.append(time.monotonic())

        call = threading.Thread(target=forward)
        call.start()
        assert trunk.started.wait(10)
        started = time.monotonic()
        server.unload("slow", drain_timeout_s=0.2)  # returns once the device thread ended its task
        call.join(10)
        assert ended[0] - started < 2.0  # the call was answered at the deadline, not when the slow task ended
        assert len(errors) == 1 and errors[0].code == "UNAVAILABLE" and "was unloaded" in str(errors[0])
        client.close()
    finally:
        server.stop(grace=0)


def test_unload_closes_sessions(two_models) -> None:
    sessions = two_models.unit("llm").sessions
    with TrunkClient(two_models.address, insecure=True, model="llm") as llm:
        llm.open_session(max_length=8)
        llm.open_session(max_length=8)
        assert len(sessions) == 2
        two_models.unload("llm")
        assert len(sessions) == 0 and sessions.stats["closed"] == 2


# -- health and metrics per model ----------------------------------------------------------------
def test_health_reports_each_model_as_its_own_service(two_models, monkeypatch) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitfed.channel.server import registry
    from splitfed.channel.server.trunkserver import SERVICE_NAME, health_name

    release = threading.Event()
    real = registry.unit_from_spec

    def slow_build(*args, **kwargs):
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(registry, "unit_from_spec", slow_build)
    status = health_pb2.HealthCheckResponse
    with grpc.insecure_channel(two_models.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def check(service: str) -> int:
            return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

        assert check(health_name("cnn")) == check(health_name("llm")) == check(SERVICE_NAME) == status.SERVING
        two_models.load(ModelSpec("mnist-cnn", name="cnn2"), wait=False)
        assert check(health_name("cnn2")) == status.NOT_SERVING  # loading
        two_models.unload("cnn")
        assert check(health_name("cnn")) == status.SERVICE_UNKNOWN
        assert check(health_name("llm")) == check(SERVICE_NAME) == status.SERVING
        two_models.unload("llm")  # the only model left is loading: the server serves none yet
        assert check(SERVICE_NAME) == status.NOT_SERVING
        release.set()
        deadline = time.monotonic() + 20
        while check(health_name("cnn2")) != status.SERVING and time.monotonic() < deadline:
            time.sleep(0.05)
        assert check(health_name("cnn2")) == check(SERVICE_NAME) == status.SERVING


def test_metrics_carry_the_model_label(llama_dir: Path) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    server = TrunkServer(models=[ModelSpec("mnist-cnn", name="cnn"),
                                 ModelSpec(str(llama_dir), name="llm", cuts=(1, 3))],
                         insecure=True, metrics_port=0).start()
    try:
        with TrunkClient(server.address, insecure=True, model="cnn") as cnn:
            for _ in range(2):
                assert _train_step(cnn) == "APPLIED"
        with TrunkClient(server.address, insecure=True, model="ghost") as ghost, pytest.raises(ChannelError):
            ghost.info()
        time.sleep(0.2)  # an RPC is counted once its status has been sent
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples[("splitfed_rpc_total", (("code", "OK"), ("method", "Forward"), ("model", "cnn")))] == 2
        assert samples[("splitfed_rpc_total", (("code", "OK"), ("method", "Forward"), ("model", "llm")))] == 0
        assert samples[("splitfed_trunk_version", (("model", "cnn"),))] == 2
        assert samples[("splitfed_trunk_version", (("model", "llm"),))] == 0
        assert ("splitfed_inference_sessions", (("model", "llm"),)) in samples
        assert not any(dict(labels).get("model") == "ghost" for _, labels in samples)  # clients mint no labels
        assert samples[("splitfed_rpc_total", (("code", "NOT_FOUND"), ("method", "Info"), ("model", "")))] == 1
        server.unload("cnn")
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
        assert 'splitfed_trunk_version{model="cnn"}' not in text and 'splitfed_trunk_version{model="llm"}' in text
    finally:
        server.stop(grace=0)


def test_one_model_server_keeps_its_single_model_api() -> None:
    """``TrunkServer(trunk)``: runtime, scheduler and servicer are the only model's; clients name no model."""
    from conftest import tiny_model

    split = split_model(tiny_model("llama").train(), cuts=(1, 3))
    server = TrunkServer(split.trunk, insecure=True, model_name="tiny").start()
    try:
        assert server.runtime is server.unit("tiny").runtime and server.servicer.sessions is not None
        with TrunkClient(server.address, insecure=True, client_id="c") as plain, \
                TrunkClient(server.address, insecure=True, model="tiny", client_id="c") as named:
            act = uuid.uuid4().hex
            out, _ = plain.forward(CutState(torch.randn(1, 3, 32)), activation_id=act, train=True)
            assert named.backward(act, torch.ones_like(out)).outcome == "APPLIED"  # same model either way
    finally:
        server.stop(grace=0)
