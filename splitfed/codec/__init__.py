"""What crosses a cut as bytes: the tensor codec, compression, finite checks, host/device copies."""
