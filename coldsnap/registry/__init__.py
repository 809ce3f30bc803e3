"""Artifacts through an OCI registry: ``coldsnap publish DIR REF`` and ``coldsnap pull REF DIR``.

An artifact travels as OCI artifacts in one repository, bound together by one image index (the
*descriptor artifact*) whose digest pins everything:

- per worker native pack: an artifact whose layers are the pack's fixed-size chunks, each its own blob, the
  manifest naming the pack's SHA-256 (its file name): one pack serves every capture that uses it, a
  registry that has a chunk is not sent it again, and the chunks go up and come down many at once (a
  restore hydrates each one as it arrives: :mod:`coldsnap.payload.arrival`);
- per launch unit, the capsule: config = ``capsule.json`` (which names every CRIU image by SHA-256), layers
  = the images and the unit's residual/recovery files, each blob digest = the digest the capsule or the
  descriptor binds;
- the descriptor manifest: config = ``artifact.json``, layers = ``request.json`` and the captured logs.

The client speaks the OCI distribution API itself (:mod:`.client`, standard library only) rather than
through ``oras``: it streams each blob from and to disk while hashing it, fetches chunks and large blobs in
parallel, resumes an interrupted pull, and reads the standard container auth files — without a dependency
that would have to travel into every serving image.
"""
