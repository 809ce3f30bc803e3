"""Process snapshot: CRIU, the CUDA checkpoint driver API, and the n610 snapshot driver (n580 is not built yet)."""
