"""The engine's event loop, and the seam between front-end processes and the engine that runs the calls."""
