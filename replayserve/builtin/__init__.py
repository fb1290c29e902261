"""The built-in model `replayserve/tiny-code` (`tiny_code.py`, weights in `tiny_code_checkpoint/`),
the tiny random checkpoints of the tests and `replayserve make-tiny` (`tiny.py`), and what trains
the built-in model (`training/`)."""
