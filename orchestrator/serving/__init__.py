"""What the Triton models call: admission, routing, token loops, text in and out."""
