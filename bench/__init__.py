"""splitfed benchmarks: ``python -m bench [--json] [--only NAME ...]``."""
