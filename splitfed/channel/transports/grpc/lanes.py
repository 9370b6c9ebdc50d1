"""The tensor-carrying calls of one gRPC channel: a client with several channels takes them in turn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from splitfed.channel.wire import fastwire
from splitfed.channel.wire import split_channel_pb2 as pb
from splitfed.channel.wire.limits import SERVICE_NAME


def _serialize(parsed: fastwire.Parsed) -> bytes:
    return fastwire.serialize(parsed.header, parsed.tensors)


@dataclass(frozen=True)
class Lane:
    """The tensor-carrying calls of one gRPC channel, with the zero-copy (de)serializers (same bytes on the
    wire)."""

    forward: Any
    backward: Any
    forward_stream: Any
    backward_stream: Any

    @staticmethod
    def of(channel: grpc.Channel) -> Lane:
        """The calls of ``channel``."""
        return Lane(
            channel.unary_unary(f"/{SERVICE_NAME}/Forward", request_serializer=_serialize,
                                response_deserializer=lambda b: fastwire.parse(pb.ForwardReply, b)),
            channel.unary_unary(f"/{SERVICE_NAME}/Backward", request_serializer=_serialize,
                                response_deserializer=lambda b: fastwire.parse(pb.BackwardReply, b)),
            channel.stream_stream(f"/{SERVICE_NAME}/ForwardStream", request_serializer=fastwire.serialize_frame,
                                  response_deserializer=fastwire.parse_frame),
            channel.stream_stream(f"/{SERVICE_NAME}/BackwardStream", request_serializer=fastwire.serialize_frame,
                                  response_deserializer=fastwire.parse_frame))
