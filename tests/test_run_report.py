"""What a run leaves a user: ``splitfed report`` shows the perplexity of a language-model run and the epsilon of
a DP run, and a DP run's stderr carries no torch warning about its first layer's backward hook, nor gRPC's
connection chatter when the trunk server stops."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

from flower_harness import ROOT, run_apps

from splitfed.cli.main import main


def test_a_dp_language_model_run_reports_perplexity_and_epsilon_and_stays_quiet(tmp_path: Path, capfd) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, out = run_apps(tmp_path, num_nodes=2, concurrency=2, num_server_rounds=1, local_steps=2,
                          model="tiny-gpt2", cuts="2,4", max_seq_len=32, batch_size=4, eval_batches=2,
                          dp_target_epsilon=8.0)
    assert not [w for w in caught if "backward hook" in str(w.message)], [str(w.message) for w in caught]
    assert "goaway" not in capfd.readouterr().err.lower()
    assert main(["report", str(out), "--plots-dir", str(tmp_path / "plots")]) == 0
    header, _, row = capfd.readouterr().out.splitlines()[:3]
    columns = dict(zip(header.split(), row.split()))
    assert 1 < float(columns["eval-ppl"]) < 8192 and 0 < float(columns["epsilon"]) <= 8.0


def test_trunk_servers_stopping_or_left_running_write_nothing_to_stderr(tmp_path: Path) -> None:
    """A server stopped under a connected client, and one a script leaves running as it ends: nothing on stderr
    (gRPC logs below ERROR stay off, GRPC_VERBOSITY defaulting to ERROR once splitfed.channel loads; a server still
    running at exit is stopped before the interpreter tears gRPC down)."""
    script = (
        "import os, torch\n"
        "assert 'GRPC_VERBOSITY' not in os.environ\n"
        "from splitfed import SplitModel, split_model\n"
        "from splitfed.channel.client.remote import RemoteTrunk\n"
        "from splitfed.channel.server.trunkserver import TrunkServer\n"
        "from splitfed.models.catalog import mnist_cnn\n"
        "parts = split_model(mnist_cnn(), (3, 6))\n"
        "server = TrunkServer(parts.trunk, insecure=True).start()\n"
        "trunk = RemoteTrunk(server.address, insecure=True)\n"
        "model = SplitModel(parts.bottom, trunk, parts.top, task='classification')\n"
        "model(torch.randn(2, 1, 28, 28), labels=torch.tensor([1, 2])).loss.backward()\n"
        "server.stop(grace=0)\n"  # the client is still connected
        "trunk.close()\n"
        "assert os.environ['GRPC_VERBOSITY'] == 'ERROR'\n"
        "left = TrunkServer(split_model(mnist_cnn(), (3, 6)).trunk, insecure=True).start()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == ""
