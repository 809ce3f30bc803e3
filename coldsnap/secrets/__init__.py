"""Secrets and capsules: a capsule is a memory dump, so nothing secret may reach the process it dumps
(docs/secrets.md).

- :mod:`coldsnap.secrets.names`: which environment variable names bear secrets.
- :mod:`coldsnap.secrets.engine_env`: the scrubbed environment a captured command starts with.
- :mod:`coldsnap.secrets.served_key`: the server's API key, refused at capture, read from a file at restore
  (the engine side: :mod:`coldsnap.agent.api_key`).
- :mod:`coldsnap.secrets.scan`: the scan of an artifact's files for token formats and secret values;
  :mod:`coldsnap.secrets.gate`: what it and the descriptor's record say before a publish.
"""
