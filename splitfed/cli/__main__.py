"""``python -m splitfed.cli``: the ``splitfed`` command."""

from splitfed.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
