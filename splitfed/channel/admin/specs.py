"""A model spec on the wire (:class:`~splitfed.serving.spec.ModelSpec` <-> ``splitfed.admin.v1.ModelSpec``).

Kept apart from the service (:mod:`splitfed.channel.server.admin`) so that the admin client, and so
``splitfed models ...``, imports neither torch nor the server's code.
"""

from __future__ import annotations

from typing import Any

from splitfed.channel.admin import model_admin_pb2 as pb
from splitfed.errors import ConfigError
from splitfed.serving.spec import ModelSpec


def spec_from_proto(msg: pb.ModelSpec) -> ModelSpec:
    """A :class:`ModelSpec` from the wire (unset fields take the defaults of ``splitfed serve``)."""
    kwargs: dict[str, Any] = {"model": msg.model, "name": msg.name, "lora_rank": msg.lora_rank,
                              "lora_alpha": msg.lora_alpha, "lora_targets": tuple(msg.lora_targets),
                              "checkpointing": msg.checkpointing, "seed": msg.seed, "frozen": msg.frozen,
                              "compile": msg.compile}
    if msg.cuts:
        if len(msg.cuts) != 2:
            raise ConfigError(f"cuts must be two integers a,b, got {list(msg.cuts)}")
        kwargs["cuts"] = tuple(msg.cuts)
    for key in ("device", "trunk_mode", "optimizer"):
        if getattr(msg, key):
            kwargs[key] = getattr(msg, key)
    for key, attr in (("quorum", "quorum"), ("max_staleness", "max_staleness"), ("trunk_timeout_s", "trunk_timeout"),
                      ("lr", "lr"), ("batch_window_ms", "batch_window_ms"), ("max_batch_tokens", "max_batch_tokens"),
                      ("shared_memory_mib", "shared_memory_mib")):
        if msg.HasField(key):
            kwargs[attr] = getattr(msg, key)
    return ModelSpec(**kwargs)


def spec_to_proto(spec: ModelSpec) -> pb.ModelSpec:
    """The wire form of ``spec`` (every field set)."""
    return pb.ModelSpec(name=spec.name, model=spec.model, cuts=list(spec.cuts or ()), lora_rank=spec.lora_rank,
                        lora_alpha=spec.lora_alpha, lora_targets=list(spec.lora_targets),
                        device=spec.device, trunk_mode=spec.trunk_mode, quorum=spec.quorum,
                        max_staleness=spec.max_staleness, trunk_timeout_s=spec.trunk_timeout,
                        optimizer=spec.optimizer, lr=spec.lr, batch_window_ms=spec.batch_window_ms,
                        max_batch_tokens=spec.max_batch_tokens, checkpointing=spec.checkpointing,
                        shared_memory_mib=spec.shared_memory_mib, seed=spec.seed, frozen=spec.frozen,
                        compile=spec.compile)


__all__ = ["spec_from_proto", "spec_to_proto"]
