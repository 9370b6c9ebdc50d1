"""CUDA events that order the copies into and out of a shared-memory region without the host waiting.

Also the UUID that names a CUDA device in every process, and the events of the
regions whose server runs in this process (a client there uses them as they are).
"""

from __future__ import annotations

import torch

from splitfed.errors import CodecError, SharedMemoryUnavailableError

__all__ = ["EVENTS_PER_REGION", "RegionEvents", "device_uuid", "device_with_uuid", "forget_local_events",
           "local_events", "remember_local_events"]

#: CUDA events per region: slices of calls in flight at once name one each.
EVENTS_PER_REGION = 64
_LOCAL_EVENTS: dict[str, RegionEvents] = {}  # by region name: a client in the server's process uses them as they are


class RegionEvents:
    """Interprocess CUDA events that order the copies into and out of a region without the host waiting.

    The writer of a slice queues its copy, records an event on its stream and sends the call; the reader's
    stream waits for that event before its own copy. Indices on the wire are 1-based.
    """

    def __init__(self, events: list[torch.cuda.Event], device: int) -> None:
        self.events = events
        self.device = device

    @classmethod
    def create(cls, device: int, count: int = EVENTS_PER_REGION) -> RegionEvents:
        """New events on ``device`` (the server's side)."""
        with torch.cuda.device(device):
            return cls([torch.cuda.Event(interprocess=True) for _ in range(count)], device)

    @classmethod
    def open(cls, device: int, handles: list[bytes]) -> RegionEvents:
        """The server's events, from their IPC handles (a client in another process)."""
        try:
            return cls([torch.cuda.Event.from_ipc_handle(device, h) for h in handles], device)
        except RuntimeError as exc:
            raise SharedMemoryUnavailableError(f"cannot open the trunk server's CUDA events: {exc}") from None

    def handles(self) -> list[bytes]:
        """The events' IPC handles."""
        return [bytes(e.ipc_handle()) for e in self.events]

    def __len__(self) -> int:
        return len(self.events)

    def __getitem__(self, index: int) -> torch.cuda.Event:
        """Event ``index`` (1-based); raises :class:`CodecError` for one the region does not have."""
        if not 1 <= index <= len(self.events):
            raise CodecError(f"event {index} is not one of the region's {len(self.events)} events")
        return self.events[index - 1]


def device_uuid(device: torch.device | int) -> str:
    """The UUID of a CUDA device ("" when it cannot be told): the same GPU has the same UUID in every process,
    whatever the device numbering there."""
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except (AttributeError, RuntimeError, AssertionError):
        return ""


def device_with_uuid(uuid: str) -> int | None:
    """This process's index of the GPU with ``uuid`` (None: not visible here)."""
    if not uuid or not torch.cuda.is_available():
        return None
    return next((i for i in range(torch.cuda.device_count()) if device_uuid(i) == uuid), None)


def local_events(name: str) -> RegionEvents | None:
    """The events of region ``name`` when its server runs in this process."""
    return _LOCAL_EVENTS.get(name)



def remember_local_events(name: str, events: RegionEvents) -> None:
    """Region ``name``'s server runs in this process and orders its copies with ``events``."""
    _LOCAL_EVENTS[name] = events


def forget_local_events(name: str) -> None:
    """Region ``name`` is closed: its events go."""
    _LOCAL_EVENTS.pop(name, None)
