"""``splitfed serve --replicas N --device ...``: where the replicas compute, refused before anything loads."""

from __future__ import annotations

import pytest
import torch

from splitfed.cli.main import main
from splitfed.errors import ConfigError
from splitfed.run.launcher import replica_device


def test_the_replicas_device_follows_the_flag() -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert replica_device(1, 2, "cpu") == torch.device("cpu")
    assert replica_device(1, 2) == (torch.device("cuda", 1) if gpus >= 2 else torch.device("cpu"))
    if gpus < 2:
        with pytest.raises(ConfigError, match=r"--device cuda with 2 replicas needs 2 GPUs .* use --device cpu"):
            replica_device(0, 2, "cuda")
    with pytest.raises(ConfigError, match=r"--device is cpu or cuda .*not 'cuda:0'"):
        replica_device(0, 2, "cuda:0")


def test_serve_refuses_a_replica_device_it_cannot_give_before_loading(capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import splitfed.cli.main as cli

    def no_build(*args: object) -> None:
        raise AssertionError("nothing may load")

    monkeypatch.setattr(cli, "_build_server", no_build)
    assert main(["serve", "--model", "mnist-cnn", "--cuts", "3,6", "--insecure", "--replicas", "2", "--device",
                 "cuda:1"]) != 0
    assert "splitfed serve: error: with --replicas 2, --device is cpu or cuda" in capsys.readouterr().err
