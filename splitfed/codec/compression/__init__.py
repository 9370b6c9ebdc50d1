"""Compression of what crosses a cut: blockwise absmax int8, top-k sparsification, error feedback.

Pure torch; knows nothing of bytes or gRPC (:mod:`splitfed.codec.tensors` turns a
:class:`Packed` tensor into bytes and back). Two compressors:

* **int8** (activations and gradients): the flattened tensor is cut into blocks
  of ``block_size`` elements; each block travels as one fp32 scale (its absolute
  maximum) and one int8 per element, ``round(x * 127 / scale)``. Decoding gives
  ``q * scale / 127``: the error of every element is at most ``scale / 254``.
* **topk** (gradients): the ``k = ceil(ratio * n)`` elements of largest
  magnitude travel with their flat positions; all others decode to zero.

**Error feedback** keeps, per sender and per tensor, what compression left out
(the residual ``x - decode(encode(x))``) and adds it to the next tensor of the
same kind before compressing it, so that nothing is lost for good: the sum of
what was transmitted over many steps tracks the sum of the true tensors.
:class:`ErrorFeedback` holds one sender's residuals (a client), :class:`FeedbackStore`
those of many clients (the trunk server), bounded in clients and bytes.

The settings are in :mod:`~splitfed.codec.compression.spec`, the arithmetic in
:mod:`~splitfed.codec.compression.kernels`, a compressed tensor and its checks in
:mod:`~splitfed.codec.compression.packed`, error feedback in
:mod:`~splitfed.codec.compression.feedback`; this package re-exports them all.
"""

from splitfed.codec.compression.feedback import (
    ErrorFeedback,
    FeedbackStore,
    compress_with_feedback,
)
from splitfed.codec.compression.kernels import (
    MAX_TOPK_ELEMENTS,
    densify,
    dequantize_int8,
    quantize_int8,
    topk_sparsify,
)
from splitfed.codec.compression.packed import Packed, check_packed, compress, decompress
from splitfed.codec.compression.spec import (
    ACTIVATION_METHODS,
    DEFAULT_BLOCK,
    MAX_BLOCK,
    METHODS,
    CompressionSpec,
    WireCompression,
)

__all__ = [
    "ACTIVATION_METHODS", "DEFAULT_BLOCK", "MAX_BLOCK", "MAX_TOPK_ELEMENTS", "METHODS", "CompressionSpec",
    "ErrorFeedback", "FeedbackStore", "Packed", "WireCompression", "check_packed", "compress",
    "compress_with_feedback", "decompress", "densify", "dequantize_int8", "quantize_int8", "topk_sparsify",
]
