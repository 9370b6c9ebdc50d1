"""Names and sizes both ends of the split channel agree on."""

from __future__ import annotations

from dataclasses import dataclass

from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.errors import ConfigError

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SplitChannel"].full_name
CLIENT_ID_KEY = "x-splitfed-client"
#: Call metadata naming the model a request is for (a server holding one model also takes requests without it).
MODEL_KEY = "x-splitfed-model"
RETRY_KEYS = ("grpc-previous-rpc-attempts", "x-splitfed-retry")


@dataclass(frozen=True)
class ChannelLimits:
    """Sizes on the wire.

    Args:
        max_message_bytes: largest single gRPC message either side accepts.
        stream_threshold_bytes: tensor payloads above this travel over the
            streaming RPCs, in chunks of ``chunk_bytes``.
        max_tensor_bytes: largest total payload of one streamed request.
    """

    max_message_bytes: int = 8 << 20
    stream_threshold_bytes: int = 4 << 20
    chunk_bytes: int = 1 << 20
    max_tensor_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not 0 < self.chunk_bytes <= self.max_message_bytes - 1024:
            raise ConfigError("chunk_bytes must be positive and leave room for framing below max_message_bytes")
        if self.stream_threshold_bytes > self.max_message_bytes - 64 * 1024:
            raise ConfigError("stream_threshold_bytes must stay 64 KiB below max_message_bytes")

    def grpc_options(self) -> list[tuple[str, int]]:
        """Channel/server options that enforce these sizes."""
        return [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes)]
