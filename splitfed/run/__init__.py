"""A SplitFed run's server side, independent of Flower, and what a run leaves behind."""
