"""A client's side of a SplitFed run, independent of Flower: rounds, training, generation, data."""
