"""The router's placement rules, without gRPC: pins per client and model, load, memory, models, holds, idle pins,
backends going down."""

from __future__ import annotations

from splitfed.channel.routing.table import ANY_MODEL, BackendState, RouteTable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _table(n: int = 2, models: tuple[str, ...] = ("m",), **kwargs: object) -> tuple[RouteTable, list[BackendState]]:
    backends = [BackendState(f"b{i}:1", i, live=True, models=frozenset(models)) for i in range(n)]
    return RouteTable(backends, **kwargs), backends  # type: ignore[arg-type]


def test_a_client_keeps_its_backend_and_new_clients_take_the_least_loaded() -> None:
    table, (b0, b1) = _table()
    assert table.pick("a", "m") is b0  # a tie goes to the first
    assert table.pick("b", "m") is b1
    b1.in_flight = 3
    assert table.pick("c", "m") is b0  # b0: 1 pinned; b1: 1 pinned + 3 in flight
    assert table.pick("b", "m") is b1  # pinned, however loaded
    assert (b0.pinned, b1.pinned) == (2, 1)


def test_memory_breaks_ties_and_pins_are_per_model() -> None:
    table, (b0, b1) = _table(models=("m", "n"))
    b0.held_bytes, b1.held_bytes = 10 << 20, 0
    assert table.pick("a", "m") is b1
    assert table.pick("a", "n") is b0  # another model: another pin, placed by load (b1 has one client now)
    assert table.pinned_to("a", "m") is b1 and table.pinned_to("a", "n") is b0


def test_only_backends_holding_the_model_and_none_when_no_live_one_does() -> None:
    table, (b0, b1) = _table()
    b1.models = frozenset({"x"})
    assert table.pick("a", "x") is b1
    assert table.pick("a", "y") is None and table.pinned_to("a", "y") is None
    assert table.pick("z", ANY_MODEL) is b0  # a call that names no model goes anywhere
    b1.live = False
    assert table.pick("b", "x") is None
    assert table.models() == ["m"]


def test_leave_ends_a_pin_unless_a_session_or_region_is_open() -> None:
    table, (b0, _) = _table()
    table.pick("a", "m")
    table.opened("a", "m")
    table.left("a", "m")
    assert table.pinned_to("a", "m") is b0  # holds a region: stays
    table.closed("a", "m")
    table.left("a", "m")
    assert table.pinned_to("a", "m") is None and b0.pinned == 0


def test_idle_pins_expire_unless_they_hold_something() -> None:
    clock = Clock()
    table, _ = _table(sticky_idle_s=10.0, clock=clock)
    table.pick("idle", "m")
    table.pick("holder", "m")
    table.opened("holder", "m")
    clock.now = 11.0
    table.pick("new", "m")  # placing a client sweeps idle pins
    assert table.pinned_to("idle", "m") is None
    assert table.pinned_to("holder", "m") is not None


def test_a_backend_going_down_ends_its_pins() -> None:
    table, (b0, b1) = _table()
    table.pick("a", "m")
    table.opened("a", "m")
    assert table.down(b0) == 1
    assert not b0.live and b0.pinned == 0
    assert table.pick("a", "m") is b1
