"""vLLM's penalty statistics out of the CUDA checkpoint.

Model Runner V2's sampler keeps, per request slot, a count of every vocabulary token the request produced
(``PenaltiesState.output_bin_counts``: max_num_seqs × vocab × int32, 501 MiB for a 128k vocabulary and
1024 slots) and a bit mask of its prompt's tokens (``prompt_bin_mask``). The CUDA checkpoint would copy
both into the image and back at every restore, yet nothing in them outlives the requests that wrote them:
a request with penalties clears its row when it is admitted (``bincount``'s ``index_fill_``), and a row
of a request without penalties is counted into but never read. So they are dropped before the checkpoint
and allocated again, zeroed as at vLLM's own start, at resume — before anything is sampled. Neither is
captured in a CUDA graph (the sampler and ``post_update`` run eagerly and read the attribute every step),
so the new tensors need not sit at the old addresses."""

from __future__ import annotations

import logging
import math
from typing import Any

__all__ = ["PenaltyStatistics"]

log = logging.getLogger("vllm.coldsnap")

ATTRIBUTES = ("output_bin_counts", "prompt_bin_mask")


class PenaltyStatistics:
    """:meth:`release` (an agent ``before_release`` hook) and :meth:`restore` (``after_resume``) of one model
    runner's penalty statistics; both idempotent, and a runner without them (V1, CPU) is left alone."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.released: dict[str, tuple[tuple[int, ...], Any, Any]] = {}
        """attribute → (shape, dtype, device) of the tensor :meth:`release` dropped."""

    @property
    def dropped_bytes(self) -> int:
        """What :meth:`release` dropped and :meth:`restore` has not allocated again."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype, _ in self.released.values())

    def _state(self) -> Any:
        return getattr(getattr(self.runner, "sampler", None), "penalties_state", None)

    def release(self) -> None:
        """Replace the statistics with empty tensors (their memory goes back to torch's cache, which the
        agent empties next); :attr:`dropped_bytes` says how much."""
        state = self._state()
        if state is None:
            return
        import torch

        for name in ATTRIBUTES:
            tensor = getattr(state, name, None)
            if not isinstance(tensor, torch.Tensor) or name in self.released or tensor.numel() == 0:
                continue
            self.released[name] = (tuple(tensor.shape), tensor.dtype, tensor.device)
            setattr(state, name, torch.empty(0, dtype=tensor.dtype, device=tensor.device))
        if self.released:
            log.info("coldsnap: vLLM's penalty statistics (%d MiB) left out of the checkpoint", self.dropped_bytes >> 20)

    def restore(self) -> None:
        """Allocate the statistics again, zeroed, as vLLM's start does."""
        state = self._state()
        if state is None or not self.released:
            return
        import torch

        for name, (shape, dtype, device) in list(self.released.items()):
            setattr(state, name, torch.zeros(shape, dtype=dtype, device=device))
            del self.released[name]
            if device.type == "cuda":  # zeroed on this thread's stream: done before the engine's streams sample
                torch.cuda.synchronize(device)
