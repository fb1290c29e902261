"""Training the built-in model: a differentiable batched forward of our Nemotron-H and its corpus."""
