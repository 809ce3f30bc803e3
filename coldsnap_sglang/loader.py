"""``--load-format coldsnap`` for SGLang: the model's weights in coldsnap's ``weights`` region.

    python -m sglang.launch_server --model-path MODEL --load-format coldsnap \
        [--model-loader-extra-config '{"mode": "auto", "pack": "/path/<sha256>.pack"}']

The loader builds the model exactly as SGLang's ``DefaultModelLoader`` does and loads it the same way
(the model's safetensors through SGLang's own weight iteration and ``load_weights``: the *recovery*
path), or, when a native pack fits the freshly built model, from the pack; then it moves every
parameter into the ``weights`` region (:mod:`coldsnap.agent.placement`). The KV cache goes to the
``kv_cache`` region through the memory saver (:mod:`coldsnap_sglang.memory_saver`), and then the agent
attaches (:mod:`coldsnap_sglang.agent_bootstrap`).

Options (``--model-loader-extra-config``): ``pack`` and ``mode`` (``auto``, ``native``, ``recovery``,
``cache-only-auto``; :func:`coldsnap.agent.placement.load_options`); the other keys go to SGLang's
default loader (``enable_multithread_load``, ``num_threads``).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Iterator, cast

import torch
from sglang.srt.configs.load_config import LoadFormat
from sglang.srt.model_loader.loader import DefaultModelLoader, _get_quantization_config, _initialize_model
from sglang.srt.model_loader.utils import set_default_torch_dtype

from coldsnap.agent.placement import PlacedModel, fitting_pack, place_weights, split_load_config, storage_offsets
from coldsnap.agent.weight_copies import WeightCopyRecorder, recovery_plan_or_none
from coldsnap.payload import NativePack
from coldsnap_sglang.process import ProcessState

__all__ = ["ColdsnapModelLoader", "LOAD_FORMAT", "OPTION"]

log = logging.getLogger("sglang.coldsnap")
LOAD_FORMAT = "coldsnap"
OPTION = "--model-loader-extra-config"


class ColdsnapModelLoader(DefaultModelLoader):
    """SGLang's default loading (or a fitting native pack), then the parameters moved into the ``weights`` region."""

    def __init__(self, load_config: Any):
        self.mode, self.pack, inner = split_load_config(load_config, OPTION, LoadFormat.SAFETENSORS)
        self.weight_files: list[str] = []
        super().__init__(inner)

    def _prepare_weights(self, *args: Any, **kwargs: Any) -> Any:
        """SGLang's, noting the safetensors it resolved (the files a capture pins for recovery)."""
        prepared = super()._prepare_weights(*args, **kwargs)  # (folder, files, use_safetensors)
        if prepared[2]:
            self.weight_files.extend(str(Path(f).resolve()) for f in prepared[1])
        return prepared

    def _weights(self, model_config: Any, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        self.weight_files = []
        return self._get_all_weights(model_config, model)

    def load_model(self, *, model_config: Any, device_config: Any) -> torch.nn.Module:
        """``DefaultModelLoader.load_model`` with one fork: when a native pack fits the freshly built
        model, its weights come from the pack (after placement) instead of the checkpoint."""
        if getattr(model_config, "modelopt_quant", None):
            raise ValueError("coldsnap's load format does not load ModelOpt-quantized models; use SGLang's own")
        if ProcessState.placed is not None:  # a second model in this process (a speculative draft)
            log.warning("coldsnap: a second model in this process (draft?) loads through SGLang's default loader; "
                        "its weights stay in ordinary memory")
            return super().load_model(model_config=model_config, device_config=device_config)
        target_device = torch.device(device_config.device)
        quant_config = _get_quantization_config(model_config, self.load_config)
        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = _initialize_model(model_config, self.load_config, quant_config)
            pack = self._fitting_pack(model)
            # A fitting pack skips SGLang's weight loading but not its post-processing (quantized
            # methods' process_weights_after_loading), which the pack's layout was written after.
            copies = WeightCopyRecorder() if pack is None else None  # where the files' bytes land: the recovery plan
            if copies is None:
                self.load_weights_and_postprocess(model, iter(()), target_device)
            else:
                with copies.recording():
                    self.load_weights_and_postprocess(model, copies.weights(self._recovery_weights(model_config, model)),
                                                      target_device)
        if pack is None:
            ProcessState.recovery_files = list(self.weight_files)
            ProcessState.recovery = functools.partial(self.replay, model, model_config)
        offsets = storage_offsets(model) if copies is not None else {}
        placed = self._place(model, pack)
        if copies is not None and ProcessState.recovery_files:
            ProcessState.recovery_plan = recovery_plan_or_none(copies, ProcessState.recovery_files, offsets, placed.region,
                                                               log, "SGLang")
        return model.eval()

    def _recovery_weights(self, model_config: Any, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            yield from self._weights(model_config, model)
        except RuntimeError as exc:
            if "Cannot find any model weights" not in str(exc):
                raise
            raise RuntimeError(f"coldsnap recovery (mode {self.mode!r}, no fitting pack) loads the model's safetensors "
                               f"through SGLang and found none: {exc}") from None

    def replay(self, model: torch.nn.Module, model_config: Any, pinned: list[str]) -> int:
        """Recovery after a restore: the pinned safetensors through SGLang's own ``load_weights`` into
        the parameters, which sit at their captured addresses in the freshly mapped ``weights`` region.
        SGLang resolves the files from the model's path again; they must be the pinned ones (admission
        verified their bytes)."""
        with torch.no_grad():
            cast(Any, model).load_weights(self._weights(model_config, model))  # the model class's own method
        if sorted(self.weight_files) != sorted(pinned):
            raise RuntimeError(f"coldsnap recovery: SGLang read the weights from {self.weight_files}, the capture "
                               f"pinned {pinned}")
        return sum(Path(f).stat().st_size for f in pinned)

    def _fitting_pack(self, model: torch.nn.Module) -> NativePack | None:
        return fitting_pack(self.pack, self.mode, model, "SGLang", log)

    def _place(self, model: torch.nn.Module, pack: NativePack | None) -> PlacedModel:
        placed = place_weights(model, pack, self.mode, log)
        ProcessState.placed = placed
        return placed
