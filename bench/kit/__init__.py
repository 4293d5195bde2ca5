"""What the benchmarks share: processes and loads, nginx, /proc readings and the docs page writer.
Nothing here imports a scenario or a one-off."""
