"""coldsnap's benchmarks, run from the repository's root as modules (``python -m benchmarks.vllm_startup``).

Each module measures a real run and writes JSON (and where it draws one, a PNG and a table); shared pieces
live in one module each: :mod:`benchmarks.restore_latency` (receipt timelines, charts, dropping the page
cache), :mod:`benchmarks.equality` (restored equals cold), :mod:`benchmarks.image_attribution` (what a
process image holds). Results of runs go to ``benchmarks/results/<run>/`` with a README saying what ran.
"""
