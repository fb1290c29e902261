"""Tensor parallelism: rank 0 runs the engine, ranks 1.. run the model runner on its plans."""
