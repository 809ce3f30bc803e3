"""Process snapshots, beneath both snapshot drivers: CRIU (:mod:`~coldsnap.snapshot.criu`; its executable,
dump, restore and replica launcher, its images and page census), the CUDA checkpoint driver API (:mod:`~coldsnap.snapshot.cuda_checkpoint`), NVML's view of
GPU memory, the host files an image opens, process trees, replicas' socket and pid rewrites. The drivers'
pipelines (n610, n580) are the launcher's: :mod:`coldsnap.activation.drivers`."""
