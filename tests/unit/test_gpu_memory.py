"""What a restore needs on each GPU of this host: the capsule's recorded use, moved with the placement."""

from __future__ import annotations

from types import SimpleNamespace

from coldsnap.activation.gpu_memory import gpu_needs
from coldsnap.activation.gpu_room import LAUNCHER_CONTEXT_BYTES
from coldsnap.activation.restore_place import GpuPlacement

GiB = 1 << 30


def _capsule():
    region = lambda backend, size: SimpleNamespace(backend=backend, high_water=size)  # noqa: E731
    workers = [SimpleNamespace(pid=10, regions={"weights": region("cuda", 15 * GiB), "kv_cache": region("cuda", 100 * GiB)}),
               SimpleNamespace(pid=11, regions={"weights": region("cuda", 15 * GiB), "scratch": region("host", GiB)})]
    used = [SimpleNamespace(pid=10, gpu_uuid="GPU-a", serving_bytes=118 * GiB),
            SimpleNamespace(pid=11, gpu_uuid="GPU-b", serving_bytes=16 * GiB),
            SimpleNamespace(pid=12, gpu_uuid="GPU-a", serving_bytes=GiB)]  # a helper process of the tree, no rank
    return SimpleNamespace(metadata=SimpleNamespace(gpu_memory=used, workers=workers))


def test_needs_follow_the_placement_and_name_their_parts():
    needs = gpu_needs(_capsule(), GpuPlacement(pairs=[("GPU-a", "GPU-y"), ("GPU-b", "GPU-x")], launcher_ordinals={}),
                      staging=True)
    assert set(needs) == {"GPU-x", "GPU-y"}
    assert needs["GPU-y"].total == 119 * GiB + LAUNCHER_CONTEXT_BYTES
    assert needs["GPU-y"].region_bytes == {"weights": 15 * GiB, "kv_cache": 100 * GiB}
    assert needs["GPU-y"].describe() == ("kv_cache 100.0 GiB, weights 15.0 GiB, graphs, contexts and other device "
                                         "state 4.0 GiB, the launcher's context 0.6 GiB")
    assert gpu_needs(_capsule(), None, staging=False)["GPU-b"].total == 16 * GiB  # unplaced: where it was captured
