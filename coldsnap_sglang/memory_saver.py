"""SGLang's memory saver, backed by coldsnap's stable regions where the ``coldsnap`` load format is used.

SGLang wraps each allocation it can give back in ``memory_saver_adapter.region(tag)`` (tags
``weights``, ``kv_cache``, ``cuda_graph``; ``sglang/srt/constants.py``). With ``--enable-memory-saver``
torch_memory_saver serves them (an LD_PRELOAD shim); otherwise the adapter does nothing. In a scheduler
process whose model the ``coldsnap`` load format loaded, :func:`create` hands out
:class:`ColdsnapMemorySaverAdapter` instead, so that:

- ``region("kv_cache")``: the KV buffers (and the request-to-token table SGLang tags with them, which it
  too treats as discardable) are allocated in coldsnap's ``kv_cache`` region (torch's pluggable
  allocator, :func:`coldsnap.memory.region`): the agent's ``prepare`` unmaps them and ``resume`` maps them
  again at the same addresses and zeroes them (the CUDA graphs captured against them stay valid);
- ``region("weights")``: nothing; the loader places the weights in the ``weights`` region itself;
- ``cuda_graph``: the adapter reports itself disabled, so SGLang captures with ``torch.cuda.graph`` into
  its own graph pool, which a TP1 capture keeps in the process image (graph policy ``retain``).

SGLang's own ``/release_memory_occupation`` and ``/resume_memory_occupation`` (and ``Engine``'s methods
of those names) are refused on a server started with ``--load-format coldsnap``, with one message
(:func:`refuse_memory_occupation`, in the server's process): coldsnap's regions are released by
``coldsnap capture`` and a standby (``coldsnap warm``/``wake``), not by SGLang's memory saver, and
answering "released" while the memory stays occupied would be a lie an RL trainer sharing the GPU
would act on. In the scheduler, the adapter's ``pause``/``resume`` do nothing and it says it is
disabled. On a CPU device there is no pluggable allocator: the adapter does nothing there.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

from coldsnap_sglang.process import ProcessState

__all__ = ["ColdsnapMemorySaverAdapter", "create", "KV_TAG", "MEMORY_OCCUPATION_REFUSED", "refuse_memory_occupation"]

log = logging.getLogger("sglang.coldsnap")
KV_TAG = "kv_cache"  # SGLang's GPU_MEMORY_TYPE_KV_CACHE and coldsnap's region tag


def _kv_region() -> Any:
    """coldsnap's ``kv_cache`` region on the weights' GPU: address space for the whole device (only what
    SGLang allocates is mapped), reserved once."""
    import torch

    from coldsnap.memory import reserve

    assert ProcessState.placed is not None
    device = ProcessState.placed.region.device
    total = torch.cuda.get_device_properties(device).total_memory
    return reserve(KV_TAG, total, backend="cuda", device=device)


class ColdsnapMemorySaverAdapter:
    """The interface of SGLang's ``TorchMemorySaverAdapter`` (duck-typed: SGLang only calls its methods)."""

    @contextlib.contextmanager
    def configure_subprocess(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False) -> Iterator[None]:
        placed = ProcessState.placed
        if tag != KV_TAG or placed is None or placed.region.backend != "cuda":
            yield
            return
        from coldsnap.memory import region

        _kv_region()
        with region(KV_TAG):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, **kwargs: Any) -> Iterator[None]:  # never called: `enabled` is False
        yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        yield

    def check_validity(self, caller_name: str) -> None:
        log.warning("coldsnap: `%s` does not release memory: under the coldsnap load format the weights and KV cache "
                    "live in coldsnap's stable regions, which `coldsnap capture` releases", caller_name)

    def pause(self, tag: str) -> None:
        pass

    def resume(self, tag: str) -> None:
        pass

    @property
    def enabled(self) -> bool:
        return False


def create(original: Callable[..., Any], enable: bool = False, *args: Any, **kwargs: Any) -> Any:
    """HookRegistry AROUND hook on ``TorchMemorySaverAdapter.create``: coldsnap's adapter once this
    process loaded its model with the ``coldsnap`` load format, else SGLang's."""
    if not ProcessState.active or ProcessState.placed is None:
        return original(enable, *args, **kwargs)
    if enable:
        log.warning("coldsnap: --enable-memory-saver is ignored under the coldsnap load format (coldsnap's stable "
                    "regions hold the weights and KV cache)")
    return ColdsnapMemorySaverAdapter()


MEMORY_OCCUPATION_REFUSED = (
    "coldsnap: SGLang's {endpoint} is not available on a server started with --load-format coldsnap: its weights "
    "and KV cache live in coldsnap's stable regions, which SGLang's memory saver cannot release or resume. Release "
    "the GPU with `coldsnap warm` (a standby that gives the memory back) and bring it back with `coldsnap wake`, "
    "or start SGLang with its own load format and --enable-memory-saver")


def refuse_memory_occupation(original: Callable[..., Any], manager: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    """HookRegistry AROUND hook on ``TokenizerControlMixin.release_memory_occupation`` and
    ``resume_memory_occupation`` (coroutines; the hook returns one): SGLang's own unless the server runs
    the coldsnap load format, then a ``ValueError`` with :data:`MEMORY_OCCUPATION_REFUSED`, which the
    HTTP route answers as an error response and ``Engine`` raises."""
    load_format = getattr(getattr(manager, "server_args", None), "load_format", None)
    if not (isinstance(load_format, str) and load_format.lower() == "coldsnap"):
        return original(manager, obj, *args, **kwargs)
    name = getattr(original, "__name__", "release_memory_occupation")

    async def refused() -> None:
        raise ValueError(MEMORY_OCCUPATION_REFUSED.format(endpoint=f"/{name}"))

    return refused()
