"""The model admin service: its own token, precise statuses for bad loads, the memory budget, and nothing
changing on a refused call."""

from __future__ import annotations

import uuid
from pathlib import Path

import grpc
import pytest
import torch
from test_serving import CNN_INPUT, save_llama

from splitfed.channel.admin.client import AdminClient, status_dict
from splitfed.channel.client.trunk import TrunkClient
from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.channel.server.units import ModelState
from splitfed.errors import ChannelError, ConfigError
from splitfed.serving.memory import Estimate, estimate, parse_budget, parse_bytes
from splitfed.serving.spec import ModelSpec
from splitfed.split import CutState

pytestmark = pytest.mark.usefixtures("one_thread")

TOKEN = "admin-" + "x" * 26


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def server():
    server = TrunkServer(models=[ModelSpec("mnist-cnn", name="cnn")], insecure=True, admin_token=TOKEN).start()
    yield server
    server.stop(grace=0)


def _state(server: TrunkServer) -> tuple[dict, int]:
    return server.models(), server.unit("cnn").runtime.version


def _call(address: str, metadata: list[tuple[str, str]]) -> grpc.RpcError:
    from splitfed.channel.admin import model_admin_pb2 as pb
    from splitfed.channel.admin import model_admin_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.ModelAdminStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Load(pb.LoadRequest(spec=pb.ModelSpec(model="mnist-cnn", name="intruder")), metadata=metadata,
                      timeout=10)
        return info.value


# -- the admin token -------------------------------------------------------------------------------
def test_admin_calls_without_or_with_a_wrong_token_are_refused_and_change_nothing(server) -> None:
    before = _state(server)
    missing = _call(server.address, [])
    assert missing.code() is grpc.StatusCode.UNAUTHENTICATED and "admin token" in missing.details()
    for bad in ("Bearer " + "y" * 32, "Bearer " + TOKEN[:-1], "Basic " + TOKEN, "Bearer " + TOKEN + "x"):
        wrong = _call(server.address, [("authorization", bad)])
        assert wrong.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED), bad
    assert _call(server.address, [("authorization", "Bearer " + "y" * 32)]).code() is \
        grpc.StatusCode.PERMISSION_DENIED
    assert _state(server) == before and "intruder" not in server.models()
    with AdminClient(server.address, TOKEN, insecure=True) as admin:  # the right token works
        assert [m.name for m in admin.list().models] == ["cnn"]


def test_a_clients_token_is_not_an_admin_token_and_the_admin_token_is_not_a_clients(tmp_path: Path) -> None:
    from splitfed.channel.security.tokens import TokenIssuer

    issuer = TokenIssuer("run-1")
    server = TrunkServer(models=[ModelSpec("mnist-cnn", name="cnn")], insecure=True, admin_token=TOKEN,
                         authenticate=issuer.authenticate).start()
    try:
        client_token = issuer.issue(7, 1)
        denied = _call(server.address, [("authorization", f"Bearer {client_token}")])
        assert denied.code() is grpc.StatusCode.PERMISSION_DENIED and "not an admin token" in denied.details()
        with TrunkClient(server.address, insecure=True, token=TOKEN, model="cnn") as admin_as_client, \
                pytest.raises(ChannelError) as info:
            admin_as_client.join()
        assert info.value.code == "UNAUTHENTICATED"
        with TrunkClient(server.address, insecure=True, token=client_token, model="cnn") as client:
            assert client.join() == 1  # the client's own token works on the channel
    finally:
        server.stop(grace=0)


def test_the_admin_service_is_off_without_a_token() -> None:
    server = TrunkServer(models=[ModelSpec("mnist-cnn", name="cnn")], insecure=True).start()
    try:
        off = _call(server.address, [("authorization", "Bearer " + TOKEN)])
        assert off.code() is grpc.StatusCode.PERMISSION_DENIED and "admin service is off" in off.details()
        assert server.models() == {"cnn": ModelState.READY}
    finally:
        server.stop(grace=0)


def test_admin_token_rules() -> None:
    with pytest.raises(ConfigError, match="at least 16"):
        TrunkServer(insecure=True, admin_token="short")
    with pytest.raises(ConfigError, match="in the clear"):
        TrunkServer(insecure=True, host="0.0.0.0", admin_token=TOKEN)
    with pytest.raises(ConfigError, match="not a loopback address"):
        AdminClient("10.1.2.3:50051", TOKEN, insecure=True)


def test_malformed_admin_request_is_invalid_argument(server) -> None:
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary("/splitfed.admin.v1.ModelAdmin/Load", request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff\xff", metadata=[("authorization", "Bearer " + TOKEN)], timeout=10)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert server.models() == {"cnn": ModelState.READY}


# -- bad loads -------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["missing-path", "bad-cuts", "no-config", "duplicate", "bad-spec"])
def test_a_bad_load_gets_a_precise_status_and_nothing_changes(server, llama_dir: Path, tmp_path: Path,
                                                              case: str) -> None:
    (tmp_path / "empty").mkdir()
    spec, code, words = {
        "missing-path": (ModelSpec(str(tmp_path / "nowhere"), name="x"), "NOT_FOUND", "does not exist"),
        "bad-cuts": (ModelSpec(str(llama_dir), name="x", cuts=(2, 9)), "INVALID_ARGUMENT", "do not fit a model of 4"),
        "no-config": (ModelSpec(str(tmp_path / "empty"), name="x"), "NOT_FOUND", "has no config.json"),
        "duplicate": (ModelSpec("mnist-cnn", name="cnn"), "ALREADY_EXISTS", "already holds model 'cnn'"),
        "bad-spec": (ModelSpec("mnist-cnn", name="x", cuts=(3, 60)), "INVALID_ARGUMENT", "cuts"),
    }[case]
    with TrunkClient(server.address, insecure=True, model="cnn") as client:
        act = uuid.uuid4().hex
        out, _ = client.forward(CutState(torch.randn(*CNN_INPUT)), activation_id=act, train=True)
        before = _state(server)
        with AdminClient(server.address, TOKEN, insecure=True) as admin:
            with pytest.raises(ChannelError) as info:
                admin.load(spec)
            assert info.value.code == code and words in str(info.value), str(info.value)
            assert [status_dict(m)["name"] for m in admin.list().models] == ["cnn"]
        assert _state(server) == before and server.registry.budget.reserved("cpu") > 0
        assert client.backward(act, torch.ones_like(out)).outcome == "APPLIED"  # its forward was kept


def test_admin_verbs_on_a_model_not_held_are_not_found(server) -> None:
    with AdminClient(server.address, TOKEN, insecure=True) as admin:
        for verb in (admin.unload, admin.reload):
            with pytest.raises(ChannelError) as info:
                verb("ghost")
            assert info.value.code == "NOT_FOUND" and "'cnn'" in str(info.value)


def test_admin_load_list_reload_unload(server, llama_dir: Path) -> None:
    with AdminClient(server.address, TOKEN, insecure=True) as admin:
        status = status_dict(admin.load(ModelSpec(str(llama_dir), name="llm", cuts=(1, 3), lora_rank=4,
                                                  optimizer="adamw", trunk_mode="async")))
        assert (status["state"], status["cuts"], status["trunk_mode"], status["lora_rank"]) == \
            ("READY", [1, 3], "async", 4)
        listed = {m.name: status_dict(m) for m in admin.list().models}
        assert set(listed) == {"cnn", "llm"} and listed["llm"]["bytes"]["cpu"] > 0
        with TrunkClient(server.address, insecure=True, model="llm") as llm:
            act = uuid.uuid4().hex
            out, _ = llm.forward(CutState(torch.randn(1, 3, 32)), activation_id=act, train=True)
            assert llm.backward(act, torch.ones_like(out)).trunk_version == 1
            assert status_dict(admin.reload("llm"))["trunk_version"] == 0  # fresh from its source
            assert llm.info().trunk_mode == "async"
        admin.unload("llm")
        assert [m.name for m in admin.list().models] == ["cnn"]


# -- the memory budget -----------------------------------------------------------------------------
def test_a_load_beyond_the_budget_is_refused_before_anything_is_allocated(llama_dir: Path, monkeypatch) -> None:
    from splitfed.channel.server import registry

    cnn = estimate(ModelSpec("mnist-cnn"))
    llm = estimate(ModelSpec(str(llama_dir), cuts=(1, 3), optimizer="adamw"))
    server = TrunkServer(models=[ModelSpec("mnist-cnn", name="cnn")], insecure=True, admin_token=TOKEN,
                         max_memory={"cpu": cnn.total + llm.total - 1}).start()
    built: list[str] = []
    real = registry.unit_from_spec
    monkeypatch.setattr(registry, "unit_from_spec", lambda spec, *a: built.append(spec.name) or real(spec, *a))
    try:
        with AdminClient(server.address, TOKEN, insecure=True) as admin:
            with pytest.raises(ChannelError) as info:
                admin.load(ModelSpec(str(llama_dir), name="llm", cuts=(1, 3), optimizer="adamw"))
            assert info.value.code == "RESOURCE_EXHAUSTED"
            assert "model 'llm' needs about" in str(info.value) and "held: cnn" in str(info.value)
            assert built == [] and server.models() == {"cnn": ModelState.READY}  # nothing was built
            assert dict(admin.list().budget) == {"cpu": cnn.total + llm.total - 1}
            # With LoRA it fits: adapters instead of full gradients and Adam state.
            admin.load(ModelSpec(str(llama_dir), name="llm", cuts=(1, 3), optimizer="adamw", lora_rank=2))
            assert built == ["llm"]
            admin.unload("cnn")  # unloads give their share back: alone, the full model fits
            admin.unload("llm")
            admin.load(ModelSpec(str(llama_dir), name="llm", cuts=(1, 3), optimizer="adamw"))
            assert server.models() == {"llm": ModelState.READY}
    finally:
        server.stop(grace=0)


def test_the_estimate_is_what_a_trained_trunk_holds(llama_dir: Path) -> None:
    """Weights and AdamW's two moments (and, within a step, the gradients), estimated from the config, against
    what the trunk holds after a step."""
    for lora in (0, 4):
        spec = ModelSpec(str(llama_dir), name="m", cuts=(1, 3), optimizer="adamw", lora_rank=lora)
        est = estimate(spec)
        server = TrunkServer(models=[spec], insecure=True).start()
        try:
            with TrunkClient(server.address, insecure=True) as client:
                act = uuid.uuid4().hex
                out, _ = client.forward(CutState(torch.randn(1, 3, 32)), activation_id=act, train=True)
                client.backward(act, torch.ones_like(out))
            held = server.unit("m").held_bytes()["cpu"]
        finally:
            server.stop(grace=0)
        # Between steps the gradients are gone (they live during a step: the estimate is the peak); AdamW's step
        # counters and the rotary tables (not in the checkpoint) are the few bytes more.
        between_steps = est.weights + est.optimizer_state
        assert between_steps <= held <= between_steps + 1024, (lora, est, held)
        assert est.trainable == (est.weights if not lora else est.optimizer_state // 2) > 0


def test_budget_and_size_parsing() -> None:
    assert parse_bytes("8GiB") == 8 << 30 and parse_bytes("1.5 MB") == 1_500_000 and parse_bytes("1024") == 1024
    assert parse_budget(["cpu=2GiB", "cuda=1GiB,cuda:1=3GiB"]) == {"cpu": 2 << 30, "cuda:0": 1 << 30,
                                                                   "cuda:1": 3 << 30}
    assert parse_budget(["4GiB"]) == {"*": 4 << 30}
    for bad in ("lots", "-1GiB", "0"):
        with pytest.raises(ConfigError):
            parse_bytes(bad)
    with pytest.raises(ConfigError, match="twice"):
        parse_budget(["cpu=1GiB", "cpu=2GiB"])
    assert Estimate("cpu", 10, 2, 4).total == 16
