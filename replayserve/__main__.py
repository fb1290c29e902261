"""``python -m replayserve``: the same command line as the ``replayserve`` script."""

from replayserve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
