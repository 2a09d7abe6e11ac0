"""Benchmark tasks. Every module in this package is imported on first use and registers its
tasks with :func:`posenc.bench.api.register_task`: adding a task is adding a file."""
