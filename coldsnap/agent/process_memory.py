"""This process's memory outside its model regions, measured and given back before a capture: the C heap's free
pages (CRIU writes every resident page into the image) and the free blocks of torch's caching allocator (the CUDA
checkpoint copies every byte the process holds on the GPU)."""

from __future__ import annotations

from coldsnap.agent.device_state import cuda_torch

__all__ = ["empty_torch_cache", "rss_bytes", "torch_device_bytes", "trim_heap"]


def trim_heap() -> None:
    """Hand the C heap's free pages back to the kernel (glibc ``malloc_trim``): freed host memory the
    allocator kept would otherwise be resident, and CRIU writes every resident page into the image."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


def rss_bytes() -> int:
    """Resident memory of this process (VmRSS)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def torch_device_bytes(allocated: bool = False) -> int:
    """GPU memory torch's caching allocator still holds outside the stable regions (graph pools,
    activations): the CUDA checkpoint copies it into the process image. ``allocated``: only what live
    tensors and graph pools use, not the cache's free blocks. 0 without CUDA torch."""
    torch = cuda_torch()
    if torch is None:
        return 0
    measure = torch.cuda.memory_allocated if allocated else torch.cuda.memory_reserved
    return sum(measure(d) for d in range(torch.cuda.device_count()))


def empty_torch_cache() -> None:
    """Hand the free blocks of torch's caching allocator back to the driver (the profile run's
    activations, warm-up buffers): the CUDA checkpoint copies every byte a process holds on the GPU into
    its image, used or not. Blocks of live CUDA-graph pools stay (their graphs replay from them). Every
    engine's agent does this; vLLM at TP 1 with graphs kept never did (0.6 GB of an 8B capture's image)."""
    torch = cuda_torch()
    if torch is None:
        return
    import gc

    gc.collect()  # tensors kept only by reference cycles free their blocks first
    # No torch.cuda.synchronize() here: this thread's current device is 0, and on a TP rank of another
    # GPU it would create a context there. empty_cache waits on each block's own device before freeing.
    torch.cuda.empty_cache()
