"""Local clusters of real tritonserver processes."""
