"""Secrets and capsules: a capsule is a memory dump, so nothing secret may reach the process it dumps.

- :mod:`coldsnap.secrets.names`: which environment variable names bear secrets.
- :mod:`coldsnap.secrets.engine_env`: the scrubbed environment a captured command starts with.
- :mod:`coldsnap.secrets.scan`: the scan of an artifact's files for token formats and secret values.
"""
