"""The researcher's examples: a custom trunk aggregator, a custom strategy around ``SplitFed``, a cut policy.

A package, so ``examples.custom_strategy:app`` names this folder's module in a Flower app's components even
where another installed distribution (opacus) ships a top-level ``examples`` package of its own.
"""
