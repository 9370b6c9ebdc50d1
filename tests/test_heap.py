"""The trunk server's start-up heap is frozen out of the garbage collector's way (``splitfed.tuning``), and a model
unloaded later is still freed, reference cycles and all."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
from conftest import tiny_model

from splitfed.channel.server.units import release_memory
from splitfed.split import split_model
from splitfed.channel.server.trunkserver import TrunkServer
from splitfed.errors import ConfigError
from splitfed.tuning import SERVING_THRESHOLDS, freeze_heap


@pytest.fixture
def unfrozen(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Freezing on (the test session turns it off), from an unfrozen heap, unfrozen again afterwards."""
    monkeypatch.setenv("SPLITFED_FREEZE_HEAP", "1")
    monkeypatch.delenv("SPLITFED_GC_THRESHOLDS", raising=False)
    gc.unfreeze()
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_a_started_trunk_server_freezes_its_heap_until_it_stops(trunk_server, unfrozen: None) -> None:
    assert gc.get_freeze_count() == 0
    python_own = gc.get_threshold()
    server = trunk_server(split_model(tiny_model("gpt2"), cuts=(1, 3)).trunk)
    assert gc.get_freeze_count() > 10_000  # torch's, transformers' and the model's objects
    assert gc.get_threshold() == SERVING_THRESHOLDS  # and the collector runs less often while it serves
    server.stop(grace=0)
    assert gc.get_freeze_count() == 0  # its objects, cycles and all, are the collector's again
    assert gc.get_threshold() == python_own


@pytest.mark.parametrize(("value", "expected"), [("1000,5,7", (1000, 5, 7)), ("default", None)])
def test_the_collector_thresholds_while_serving_can_be_set(trunk_server, unfrozen: None,
                                                           monkeypatch: pytest.MonkeyPatch, value: str,
                                                           expected: tuple[int, int, int] | None) -> None:
    monkeypatch.setenv("SPLITFED_GC_THRESHOLDS", value)
    python_own = gc.get_threshold()
    trunk_server(split_model(tiny_model("gpt2"), cuts=(1, 3)).trunk)
    assert gc.get_freeze_count() > 0 and gc.get_threshold() == (expected or python_own)


@pytest.mark.parametrize("value", ["1000,5", "a,b,c", "0,10,10"])
def test_malformed_collector_thresholds_fail_before_the_server_starts(monkeypatch: pytest.MonkeyPatch,
                                                                       value: str) -> None:
    monkeypatch.setenv("SPLITFED_GC_THRESHOLDS", value)
    with pytest.raises(ConfigError, match="SPLITFED_GC_THRESHOLDS"):
        TrunkServer(split_model(tiny_model("gpt2"), cuts=(1, 3)).trunk, port=0, insecure=True)


def test_setting_freeze_heap_to_0_leaves_the_collector_alone(trunk_server, unfrozen: None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITFED_FREEZE_HEAP", "0")
    trunk_server(split_model(tiny_model("gpt2"), cuts=(1, 3)).trunk)
    assert gc.get_freeze_count() == 0


class _Cyclic:
    """A model-like object in a reference cycle: only a collection over it frees it."""

    def __init__(self) -> None:
        self.weights = torch.zeros(1024)
        self.me = self


def test_an_object_frozen_in_a_cycle_is_freed_when_a_model_is_released(unfrozen: None) -> None:
    held = _Cyclic()
    gone = weakref.ref(held)
    assert freeze_heap()
    del held
    gc.collect()
    assert gone() is not None  # a plain collection skips frozen objects
    release_memory("cpu")  # what the server runs once a model's unit is dropped
    assert gone() is None
    assert gc.get_freeze_count() > 0  # and what is left is frozen again
