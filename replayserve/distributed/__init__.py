"""Tensor parallelism's processes: rank 0 runs the engine, ranks 1.. run the model runner on its plans
(the slices they run are cut by `models/sharding.py`; the collectives are in `layers/tensor_parallel.py`)."""
