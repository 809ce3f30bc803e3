"""``--load-format coldsnap`` for vLLM: the model's weights in coldsnap's ``weights`` region.

    vllm serve MODEL --load-format coldsnap [--model-loader-extra-config '{"mode": "auto"}']

The loader builds and loads the model exactly as vLLM's default loader does (weights come through
vLLM's own iteration of the model's safetensors: the *recovery* path), runs
``process_weights_after_loading``, then moves every parameter and buffer into the ``weights`` region.
The KV cache goes to the ``kv_cache`` region (:mod:`coldsnap_vllm.kv_cache`), and then the agent
attaches (:mod:`coldsnap_vllm.agent_bootstrap`): under ``coldsnap capture`` its ``prepare`` writes the
native pack from the regions and releases them, ``resume`` hydrates them at the same addresses and
zeroes the KV cache (vLLM does not zero on wake; coldsnap does).

On CPUs, vLLM normally repacks linear weights for oneDNN/SGL kernels into buffers it owns (dropping
the originals), which would put the weights back into the process image; the loader keeps them as
plain tensors in the region and lets vLLM use ``torch.nn.functional.linear`` on them.

Options (``--model-loader-extra-config``): ``pack`` — a native pack to start from; ``mode`` — ``auto``
(default) and ``cache-only-auto`` use the pack when it fits this model, else load through vLLM;
``native`` requires a fitting pack; ``recovery`` always loads through vLLM. Other keys go to vLLM's
default loader.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Iterator

import torch
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.logger import init_logger
from vllm.platforms import current_platform

from coldsnap.agent.placement import MODES, PlacedModel, fitting_pack, place_weights, split_load_config, storage_offsets
from coldsnap.agent.weight_copies import WeightCopyRecorder, recovery_plan_or_none
from coldsnap.payload import NativePack
from coldsnap_vllm import compat
from coldsnap_vllm.process import ProcessState

__all__ = ["ColdsnapModelLoader", "LOAD_FORMAT", "MODES"]

log = init_logger("vllm.coldsnap")  # vLLM's logger: the lines show in vLLM's own log format
LOAD_FORMAT = "coldsnap"
OPTION = "--model-loader-extra-config"


@contextlib.contextmanager
def _plain_cpu_linear() -> Iterator[None]:
    """On CPU, keep linear weights as tensors (vLLM would repack them into kernel-owned buffers)."""
    if not current_platform.is_cpu():
        yield
        return
    import vllm.model_executor.layers.utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm

    def keep_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        # setattr: torch types Module attributes as tensors or modules, and this one is a function
        setattr(layer, "cpu_linear", torch.nn.functional.linear)

    layer_utils.dispatch_cpu_unquantized_gemm = keep_weight
    try:
        yield
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = original


@register_model_loader(LOAD_FORMAT)
class ColdsnapModelLoader(DefaultModelLoader):
    """vLLM's default loading, then the model's tensors moved into the ``weights`` region."""

    def __init__(self, load_config: Any):
        self.mode, self.pack, inner = split_load_config(load_config, OPTION, "safetensors")
        self.weight_files: list[str] = []
        self.copies: WeightCopyRecorder | None = None  # while a recovery load records its plan
        super().__init__(inner)

    def _prepare_weights(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's, noting the safetensors it resolved (the files a capture pins for recovery)."""
        prepared = super()._prepare_weights(*args, **kwargs)  # (folder, files, use_safetensors[, ...])
        if prepared[2]:
            self.weight_files = [str(Path(f).resolve()) for f in prepared[1]]
        return prepared

    def get_all_weights(self, model_config: Any, model: torch.nn.Module) -> Any:
        """vLLM's, watched by the recorder while a recovery load records its plan."""
        weights = super().get_all_weights(model_config, model)
        return self.copies.weights(weights) if self.copies is not None else weights

    def replay(self, model: torch.nn.Module, model_config: Any, pinned: list[str]) -> int:
        """Recovery after a restore: the pinned safetensors through vLLM's own weight loaders into the
        parameters, which sit at their captured addresses in the freshly mapped ``weights`` region (it
        holds nothing else: placement leaves buffers in the process image). vLLM resolves the files
        from the model's path again; they must be the pinned ones (admission verified their bytes)."""
        self.weight_files = []
        with compat.lookup(compat.SET_CURRENT_CONFIG)(self.vllm_config), torch.no_grad():  # as at load time
            self.load_weights(model, model_config)
        if sorted(self.weight_files) != sorted(pinned):
            raise RuntimeError(f"coldsnap recovery: vLLM read the weights from {self.weight_files}, the capture pinned "
                               f"{pinned}")
        return sum(Path(f).stat().st_size for f in pinned)

    def _recover(self, model: torch.nn.Module, model_config: Any) -> None:
        """Recovery: the weights through vLLM's own iteration of the model's safetensors."""
        try:
            self.load_weights(model, model_config)
        except RuntimeError as exc:
            if "Cannot find any model weights" not in str(exc):
                raise
            raise RuntimeError(f"coldsnap recovery (mode {self.mode!r}, no fitting pack) loads the model's safetensors "
                               f"through vLLM and found none: {exc}") from None

    def get_external_weight_memory(self, vllm_config: Any) -> int:
        """0, deliberately. vLLM asks this in ``init_device`` for weights that exist *before* its startup
        memory snapshot (another process's, as with ``ipc_cache``) and takes them out of the engine's
        budget. coldsnap's weights are allocated in this worker after that snapshot — loaded, then
        moved into the ``weights`` region, or hydrated there from a pack — so vLLM's profiling already
        sees them (as the memory the region maps); reporting them here would count them twice and
        shrink the KV cache by the model's size. (Reasoned from vLLM 0.33's ``request_memory`` and
        ``determine_available_memory``; vLLM's CPU worker never calls this, and no GPU run has checked
        the resulting KV budget.)"""
        return 0

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> torch.nn.Module:
        """vLLM's BaseModelLoader.load_model with one fork: when a native pack fits the freshly built
        model, its weights come from the pack (after placement) instead of the checkpoint. The model
        is built once either way (vLLM refuses to register its attention layers twice)."""
        compat.refuse_hisparse(vllm_config)  # its KV cache would escape coldsnap's region: a reason, not a timeout
        self.vllm_config = vllm_config
        if compat.online_quantized_before_build(vllm_config):  # 0.33: quantized while loading: vLLM's own path
            with _plain_cpu_linear():
                model = super().load_model(vllm_config, model_config, prefix)
            self._place(model, None)
            return model
        load_device = vllm_config.device_config.device if self.load_config.device is None else self.load_config.device
        target_device = torch.device(load_device)
        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = compat.create_model(self, vllm_config, model_config, prefix)
            online = compat.online_quantized_model(model)  # 0.26 tells it from the built model
            pack = None if online else self._fitting_pack(model)
            if pack is None:
                self.copies = WeightCopyRecorder()
                try:
                    with self.copies.recording():
                        self._recover(model, model_config)
                except BaseException:
                    self.copies = None
                    raise
                if compat.available(compat.SET_CURRENT_CONFIG, compat.PREPARE_WEIGHTS):  # else restores need the pack
                    ProcessState.recovery_files = list(self.weight_files)
                    ProcessState.recovery = functools.partial(self.replay, model, model_config)
            if online:
                compat.finalize_online_quantization(model, model_config)
            with _plain_cpu_linear():
                process_weights_after_loading(model, model_config, target_device)
        offsets = storage_offsets(model) if self.copies is not None else {}
        placed = self._place(model, pack)
        if self.copies is not None and ProcessState.recovery_files:
            ProcessState.recovery_plan = recovery_plan_or_none(self.copies, ProcessState.recovery_files, offsets,
                                                               placed.region, log, "vLLM")
        self.copies = None
        return model.eval()

    def _fitting_pack(self, model: torch.nn.Module) -> NativePack | None:
        return fitting_pack(self.pack, self.mode, model, "vLLM", log)

    def _place(self, model: torch.nn.Module, pack: NativePack | None) -> PlacedModel:
        placed = place_weights(model, pack, self.mode, log)
        ProcessState.placed = placed
        return placed


