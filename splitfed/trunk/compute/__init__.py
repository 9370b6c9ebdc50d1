"""The trunk runtime: batched forwards and backwards of the middle blocks, saved forwards, versions."""
