"""Example models and tasks: the package's transformer, decoder LMs written the ways Flax users
write them, and a real-text task."""
