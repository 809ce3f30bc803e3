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

from coldsnap.agent.placement import (PackDoesNotFit, append_model_to_region, check_pack_fits, fitting_pack, place_weights,
                                      planned_extents, split_load_config, storage_offsets)
from coldsnap.agent.weight_copies import WeightCopyRecorder, recovery_plan_or_none
from coldsnap.hydrate.recovery_plan import RecoveryPlan
from coldsnap.payload import NativePack
from coldsnap.payload.errors import PackError
from coldsnap_sglang import compat
from coldsnap_sglang.process import ProcessState

__all__ = ["ColdsnapModelLoader", "DRAFT_PREFIX", "LOAD_FORMAT", "OPTION"]

log = logging.getLogger("sglang.coldsnap")
LOAD_FORMAT = "coldsnap"
OPTION = "--model-loader-extra-config"
DRAFT_PREFIX = "draft."  # the draft's tensors in the layout and pack (its names are its target's too)


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
        model, its weights come from the pack (after placement) instead of the checkpoint. A speculative
        draft (SGLang's ``is_draft_model``) is placed right after the target in the same region
        (:meth:`_load_draft`)."""
        if getattr(model_config, "modelopt_quant", None):
            raise ValueError("coldsnap's load format does not load ModelOpt-quantized models; use SGLang's own")
        if getattr(model_config, "is_draft_model", False):
            return self._load_draft(model_config, device_config)
        if ProcessState.placed is not None:
            log.warning("coldsnap: a second target model in this process loads through SGLang's default loader; its "
                        "weights stay in ordinary memory (and the process image)")
            return super().load_model(model_config=model_config, device_config=device_config)
        target_device = torch.device(device_config.device)
        draft_follows = compat.speculative_draft_load_format() in (compat.INHERITED, LOAD_FORMAT)
        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = _initialize_model(model_config, self.load_config, _get_quantization_config(model_config, self.load_config))
            pack = fitting_pack(self.pack, self.mode, model, "SGLang", log, followed=draft_follows)
            copies = self._load_weights(model, model_config, target_device, pack is not None)
        offsets = storage_offsets(model) if copies is not None else {}
        placed = place_weights(model, pack, self.mode, log, followed=draft_follows,
                               reserve_bytes=_device_bytes(target_device) if draft_follows else 0)
        ProcessState.placed = placed
        ProcessState.draft_expected = draft_follows
        ProcessState.draft_in_pack = draft_follows and pack is not None
        if copies is not None:
            self._note_recovery(model, model_config, copies, offsets)
        return model.eval()

    def _load_draft(self, model_config: Any, device_config: Any) -> torch.nn.Module:
        """The speculative draft: built and loaded as the target was,
        its parameters placed after the target's in the same ``weights`` region, so that the pack holds
        both models and a restore hydrates both at once. Where the target's pack already held it, the
        draft's parameters are rebound to those bytes. Without room in the region (the target did not
        expect a draft), SGLang's default loader keeps it in ordinary memory (in the process image)."""
        placed = ProcessState.placed
        target_device = torch.device(device_config.device)
        if placed is None or ProcessState.draft is not None or not ProcessState.draft_expected:
            why = ("the target is not placed yet" if placed is None else "a draft is placed already"
                   if ProcessState.draft is not None else "the target was placed without room for a draft: SGLang "
                   "did not say one follows")
            log.warning("coldsnap: the speculative draft model loads through SGLang's default loader (%s); its weights "
                        "stay in ordinary memory (and the process image)", why)
            return super().load_model(model_config=model_config, device_config=device_config)
        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = _initialize_model(model_config, self.load_config, _get_quantization_config(model_config, self.load_config))
            from_pack = ProcessState.draft_in_pack
            if from_pack:
                try:  # the region holds the pack's bytes after the target's: they must be this model's
                    check_pack_fits(NativePack.open(self.pack), planned_extents(model, placed.end), start=placed.end)  # type: ignore[arg-type]
                except (PackDoesNotFit, PackError) as exc:
                    if self.mode == "native":
                        raise ValueError(f"coldsnap mode 'native': the draft model: {exc}") from None
                    log.warning("coldsnap: the draft model: %s; loading it through SGLang instead", exc)
                    from_pack = False
            copies = self._load_weights(model, model_config, target_device, from_pack)
        offsets = storage_offsets(model, placed.end) if copies is not None else {}
        draft = append_model_to_region(model, placed, prefix=DRAFT_PREFIX, copy=not from_pack)
        ProcessState.draft = draft
        log.info("coldsnap: the speculative draft's %d bytes of weights in the weights region after the target's (%s)",
                 draft.bytes, "from the native pack" if from_pack else "loaded through SGLang")
        if copies is not None and not ProcessState.draft_in_pack:  # a target from a pack: no recovery for either
            self._note_recovery(model, model_config, copies, offsets)
        return model.eval()

    def _load_weights(self, model: torch.nn.Module, model_config: Any, target_device: torch.device,
                      from_pack: bool) -> WeightCopyRecorder | None:
        """SGLang's weight loading and post-processing into the freshly built ``model``, recording where
        the files' bytes land (the recovery plan); ``from_pack``: only the post-processing (quantized
        methods' ``process_weights_after_loading``, which the pack's layout was written after)."""
        if from_pack:
            self.load_weights_and_postprocess(model, iter(()), target_device)
            return None
        copies = WeightCopyRecorder()
        with copies.recording():
            self.load_weights_and_postprocess(model, copies.weights(self._recovery_weights(model_config, model)),
                                              target_device)
        return copies

    def _note_recovery(self, model: torch.nn.Module, model_config: Any, copies: WeightCopyRecorder,
                       offsets: dict[int, int]) -> None:
        """This model's safetensors join the files a capture pins, its replay the recovery, its copies the
        recovery plan (the draft's after the target's: one plan for the one region)."""
        assert ProcessState.placed is not None
        files = list(self.weight_files)
        ProcessState.recovery_files = [*ProcessState.recovery_files, *files]
        ProcessState.replays.append(functools.partial(self.replay, model, model_config, files))
        ProcessState.recovery = replay_all
        if not files:
            return
        plan = recovery_plan_or_none(copies, files, offsets, ProcessState.placed.region, log, "SGLang")
        first = ProcessState.recovery_plan
        if len(ProcessState.replays) == 1:
            ProcessState.recovery_plan = plan
        elif plan is None or first is None:
            ProcessState.recovery_plan = None  # replay through SGLang's loaders, both models
        else:
            ProcessState.recovery_plan = RecoveryPlan(first.layout_digest, sorted(
                [*first.copies, *plan.copies], key=lambda copy: copy.region_offset))

    def _recovery_weights(self, model_config: Any, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            yield from self._weights(model_config, model)
        except RuntimeError as exc:
            if "Cannot find any model weights" not in str(exc):
                raise
            raise RuntimeError(f"coldsnap recovery (mode {self.mode!r}, no fitting pack) loads the model's safetensors "
                               f"through SGLang and found none: {exc}") from None

    def replay(self, model: torch.nn.Module, model_config: Any, files: list[str], pinned: list[str]) -> int:
        """Recovery after a restore: this model's safetensors through SGLang's own ``load_weights`` into
        the parameters, which sit at their captured addresses in the freshly mapped ``weights`` region.
        SGLang resolves the files from the model's path again; they must be the ones it loaded at
        capture, and pinned (admission verified their bytes)."""
        with torch.no_grad():
            cast(Any, model).load_weights(self._weights(model_config, model))  # the model class's own method
        if sorted(self.weight_files) != sorted(files) or not set(files) <= set(pinned):
            raise RuntimeError(f"coldsnap recovery: SGLang read the weights from {self.weight_files}, the capture "
                               f"loaded {files} and pinned {pinned}")
        return sum(Path(f).stat().st_size for f in files)


def replay_all(pinned: list[str]) -> int:
    """Recovery of every model this process placed (the target, then its draft): bytes read."""
    return sum(replay(pinned) for replay in ProcessState.replays)


def _device_bytes(device: torch.device) -> int:
    """Address space for the whole device: what a region reserves for models whose sizes are not known yet."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.get_device_properties(device).total_memory)
