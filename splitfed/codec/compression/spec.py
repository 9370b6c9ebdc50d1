"""What to compress at the cut and how: the settings of one kind of tensor, and of a client's two directions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from splitfed.errors import ConfigError

METHODS = ("none", "int8", "topk")
#: Compressors for activations (top-k of an activation would drop most of the example).
ACTIVATION_METHODS = ("none", "int8")
DEFAULT_BLOCK = 128
MAX_BLOCK = 1 << 20


@dataclass(frozen=True)
class CompressionSpec:
    """How one kind of tensor is compressed.

    Args:
        method: ``none``, ``int8`` (blockwise absmax) or ``topk``.
        topk_ratio: fraction of the elements top-k keeps, in (0, 1].
        block_size: elements per int8 scale.
        error_feedback: carry the compression error into the next tensor of the same kind.
    """

    method: str = "none"
    topk_ratio: float = 0.01
    block_size: int = DEFAULT_BLOCK
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"compression method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if not 0.0 < self.topk_ratio <= 1.0:
            raise ConfigError(f"topk-ratio must be in (0, 1], got {self.topk_ratio}")
        if not 0 < self.block_size <= MAX_BLOCK:
            raise ConfigError(f"int8 block size must be in 1..{MAX_BLOCK}, got {self.block_size}")

    @property
    def active(self) -> bool:
        """Whether tensors are compressed at all."""
        return self.method != "none"

    def topk_count(self, numel: int) -> int:
        """Elements top-k keeps of ``numel``: ``ceil(ratio * numel)``, at least one."""
        return min(numel, max(1, math.ceil(self.topk_ratio * numel)))


@dataclass(frozen=True)
class WireCompression:
    """What a client compresses at the cut: activations (int8) and gradients (int8 or top-k).

    ``activations`` applies to the hidden state a client sends and the trunk's
    output the server returns; ``gradients`` to the gradient a client sends and
    the input gradient the server returns. Each side compresses what it sends;
    error feedback (``gradients.error_feedback``) is kept by each side for what
    it sends. Activations never carry error feedback: an activation's error
    belongs to its own batch.
    """

    activations: CompressionSpec = field(default_factory=CompressionSpec)
    gradients: CompressionSpec = field(default_factory=CompressionSpec)

    def __post_init__(self) -> None:
        if self.activations.method not in ACTIVATION_METHODS:
            raise ConfigError(f"activations can be compressed with {', '.join(ACTIVATION_METHODS)}, not "
                              f"{self.activations.method!r}; top-k applies to gradients (wire-compression-grad)")

    @classmethod
    def of(cls, value: WireCompression | str | None, *, grad: str = "", act: str = "", topk_ratio: float = 0.01,
           block_size: int = DEFAULT_BLOCK, error_feedback: bool = True) -> WireCompression:
        """Build from a name: ``int8`` compresses both directions; ``topk`` gradients only (activations raw).

        ``act`` and ``grad`` (non-empty) override the method for activations and gradients.
        """
        if isinstance(value, WireCompression):
            return value
        name = value or "none"
        if name not in METHODS:
            raise ConfigError(f"wire-compression must be one of {', '.join(METHODS)}; got {name!r}")
        act_method = act or ("none" if name == "topk" else name)
        grad_method = grad or name
        return cls(CompressionSpec(act_method, topk_ratio, block_size, error_feedback=False),
                   CompressionSpec(grad_method, topk_ratio, block_size, error_feedback))

    def describe(self) -> str:
        """A short description for logs: ``activations int8, gradients topk 0.01 (error feedback)``."""
        def one(spec: CompressionSpec) -> str:
            return f"topk {spec.topk_ratio:g}" if spec.method == "topk" else spec.method
        ef = " (error feedback)" if self.gradients.active and self.gradients.error_feedback else ""
        return f"activations {one(self.activations)}, gradients {one(self.gradients)}{ef}"


__all__ = ["ACTIVATION_METHODS", "DEFAULT_BLOCK", "MAX_BLOCK", "METHODS", "CompressionSpec", "WireCompression"]
