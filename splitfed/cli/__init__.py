"""The ``splitfed`` console command and its sub-commands."""
