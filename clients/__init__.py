"""Command-line clients: generate through Triton, load tests."""
