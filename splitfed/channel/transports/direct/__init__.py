"""Direct calls: Forward and Backward over a Unix socket straight to the engine."""
