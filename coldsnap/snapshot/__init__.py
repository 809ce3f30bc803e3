"""Process snapshot: CRIU, the CUDA checkpoint driver API, and the n580/n610 snapshot drivers."""
