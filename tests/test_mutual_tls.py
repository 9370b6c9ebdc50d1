"""Mutual TLS on the split channel through the apps: the trunk requires client certificates (``tls-client-ca``),
each node presents its own (``tls-client-cert``/``tls-client-key``, from the run config or the node's
``--node-config``); a node without one fails with the keys to set, one from another CA is refused. Certificates
are made with ``openssl`` as an operator would (``tests/pki.py``); ``tests/test_e2e_tls.py`` runs the same through
``flwr run``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from flower_harness import run_apps
from pki import Pki, make_pki

from splitfed.channel.client.trunk import RetryPolicy, TrunkClient
from splitfed.config import NODE_KEYS, RunConfig
from splitfed.errors import ChannelError, ConfigError, RoundFailedError
from splitfed.run.rundirs import latest_run
from splitfed.split import CutState

FAIL_FAST = RetryPolicy(max_attempts=2, initial_backoff_s=0.05)  # a refused handshake is not transient


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), nodes=2)


def _server_keys(pki: Pki) -> dict[str, str]:
    """The run's keys for a trunk with the operator's certificate that requires client certificates."""
    return {"tls_cert": pki.cert("server"), "tls_key": pki.key("server"), "tls_root_ca": pki.cert("ca"),
            "tls_client_ca": pki.cert("ca")}


def _own(pki: Pki, name: str) -> dict[str, str]:
    """A node's --node-config: its own certificate and key."""
    return {"tls-client-cert": pki.cert(name), "tls-client-key": pki.key(name)}


def _history(out: Path) -> dict:
    return json.loads((out / "history.json").read_text())


def test_each_node_presents_its_own_certificate_from_its_node_config(tmp_path: Path, pki: Pki) -> None:
    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=2, eval_batches=2,
                      node_configs={0: _own(pki, "node-0"), 1: _own(pki, "node-1")}, **_server_keys(pki))
    (round1,) = _history(out)["rounds"]
    assert round1["failures"]["train"] == 0 and round1["failures"]["evaluate"] == 0
    assert round1["train"]["train-steps"] == 2 * 2  # both nodes trained through the mutual-TLS trunk
    assert round1["evaluate"]["num-examples"] > 0


def test_a_node_without_a_certificate_fails_naming_the_keys_to_set(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(RoundFailedError, match="tls-client-cert and tls-client-key") as info:
        run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=2, **_server_keys(pki))
    assert "--node-config" in str(info.value) and "ConfigError" in str(info.value)
    run_dir = latest_run(tmp_path / "outputs")  # the failed run's own folder
    assert run_dir is not None
    history = _history(run_dir)
    assert history["status"] == "failed" and history["rounds"][0]["failures"]["train"] == 2
    assert not (run_dir / "model").exists()


def test_a_node_whose_certificate_another_ca_signed_is_refused(tmp_path: Path, pki: Pki) -> None:
    # Node 0 presents ours, node 1 a stranger's: the round goes on with node 0 alone (min-train-nodes = 1).
    _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=2, eval_batches=2,
                      min_train_nodes=1, node_configs={0: _own(pki, "node-0"), 1: _own(pki, "stranger")},
                      **_server_keys(pki))
    (round1,) = _history(out)["rounds"]
    assert round1["failures"]["train"] == 1 and round1["train"]["train-steps"] == 2
    assert "ChannelError" in round1["failures"]["first-error"] and "UNAVAILABLE" in round1["failures"]["first-error"]


def test_tls_client_ca_with_the_trunks_own_certificate_requires_client_certificates(pki: Pki, trunk_server
                                                                                     ) -> None:
    """Without ``tls-cert`` the trunk issues its certificate (on loopback too); ``tls-client-ca`` still holds."""
    from conftest import tiny_model

    from splitfed.channel.security.policy import ServerTransport, TransportMode, client_credentials
    from splitfed.split import split_model

    transport = ServerTransport.from_settings("127.0.0.1", tls_client_ca=pki.cert("ca"))
    assert transport.mode is TransportMode.AUTO_TLS and "client certificates required" in transport.describe()
    server = trunk_server(split_model(tiny_model("llama").train(), cuts=(1, 3)).trunk, insecure=False,
                          credentials=transport.credentials())
    hidden = CutState(torch.randn(2, 5, 32))

    def creds(name: str | None) -> object:
        pair = {} if name is None else {"client_cert": pki.cert(name), "client_key": pki.key(name)}
        return client_credentials(server.address, pinned_ca=transport.ca_pem, **pair)

    assert TrunkClient(server.address, credentials=creds("node-0")).forward(hidden, train=False)[0].shape == (2, 5, 32)
    for name in (None, "stranger"):
        with pytest.raises(ChannelError) as info:
            TrunkClient(server.address, credentials=creds(name), retry=FAIL_FAST).forward(hidden, train=False)
        assert info.value.code == "UNAVAILABLE", name


def test_node_keys_override_the_run_config_and_half_pairs_are_refused(pki: Pki) -> None:
    run = RunConfig.from_mapping({"tls-client-cert": "/run/node.pem", "tls-client-key": "/run/node.key"})
    node = run.for_node({"partition-id": 1, "num-partitions": 2, **_own(pki, "node-1"), "tls-root-ca": "/n/ca.pem"})
    assert (node.tls_client_cert, node.tls_client_key, node.tls_root_ca) == (
        pki.cert("node-1"), pki.key("node-1"), "/n/ca.pem")
    assert run.for_node({"partition-id": 0, "num-partitions": 2}) is run  # nothing of its own: the run's values
    assert NODE_KEYS == ("tls-client-cert", "tls-client-key", "tls-root-ca")
    for settings, fragment in [
        ({"tls-client-cert": "node.pem"}, "tls-client-cert and tls-client-key go together"),
        ({"tls-client-ca": "ca.pem", "trunk-insecure": True}, "remove trunk-insecure"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            RunConfig.from_mapping(settings)
    with pytest.raises(ConfigError, match="tls-client-cert and tls-client-key go together"):
        run.for_node({"tls-client-key": ""})
