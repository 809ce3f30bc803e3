"""Recovery plans: copies recorded while a model loads its own way (a fused projection, a converted
dtype, a fill), turned into a plan of file ranges → region offsets, checked against the placed bytes;
applied to a fresh region with the gap pack, they put back exactly the bytes a native pack would."""

from __future__ import annotations

import json
import struct

import pytest

torch = pytest.importorskip("torch")

from coldsnap.agent.memory import ModelMemory  # noqa: E402
from coldsnap.agent.placement import layout_for, place_model_in_region, storage_offsets  # noqa: E402
from coldsnap.agent.weight_copies import WeightCopyRecorder  # noqa: E402
from coldsnap.hydrate.recovery_plan import subtract_extents  # noqa: E402


def _safetensors(path, tensors: dict[str, "torch.Tensor"]) -> None:
    header, blobs, at = {}, [], 0
    for name, tensor in tensors.items():
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": {torch.bfloat16: "BF16", torch.float32: "F32"}[tensor.dtype],
                        "shape": list(tensor.shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def _read(files):
    """(name, CPU tensor) of every tensor of the files, as a safetensors iterator yields them."""
    from coldsnap.hydrate.replay import SafetensorsIndex

    for name, entry in SafetensorsIndex(files).entries.items():
        with open(entry.file, "rb") as handle:
            handle.seek(entry.file_offset)
            data = bytearray(handle.read(entry.length))
        yield name, torch.frombuffer(data, dtype=getattr(torch, entry.dtype)).reshape(entry.shape)


class _Model(torch.nn.Module):
    """A fused q/k projection (two checkpoint tensors → one parameter), a weight converted from float32,
    and a padded embedding whose padding the loader fills."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = torch.nn.Parameter(torch.empty(6, 64, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.empty(64, dtype=torch.bfloat16), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.empty(8, 64, dtype=torch.bfloat16), requires_grad=False)

    def load(self, weights) -> None:  # as an engine's loaders do
        for name, tensor in weights:
            if name in ("q", "k"):
                rows = slice(0, 4) if name == "q" else slice(4, 6)
                self.qk.data[rows].copy_(tensor)
            elif name == "norm":
                self.norm.data.copy_(tensor.to(torch.bfloat16))  # converted: not a plain copy
            elif name == "embed":
                self.embed.data[:tensor.shape[0]].copy_(tensor)
                self.embed.data[tensor.shape[0]:].fill_(0)  # padding: filled, not copied


def test_a_recorded_plan_with_its_gap_restores_the_placed_bytes(tmp_path):
    torch.manual_seed(0)
    checkpoint = {"q": torch.randn(4, 64).to(torch.bfloat16), "k": torch.randn(2, 64).to(torch.bfloat16),
                  "norm": torch.randn(64), "embed": torch.randn(5, 64).to(torch.bfloat16)}
    files = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    _safetensors(files[0], {"q": checkpoint["q"], "norm": checkpoint["norm"]})
    _safetensors(files[1], {"k": checkpoint["k"], "embed": checkpoint["embed"]})
    model, recorder = _Model(), WeightCopyRecorder()
    with recorder.recording():
        model.load(recorder.weights(_read(files)))
    offsets = storage_offsets(model)
    placed = place_model_in_region(model)
    plan = recorder.plan([str(f) for f in files], offsets, placed.region)
    # q, k and the embedding's 5 rows are plain copies; the converted norm and the padding are not
    assert sorted(c.length for c in plan.copies) == [2 * 64 * 2, 4 * 64 * 2, 5 * 64 * 2]
    memory = ModelMemory(layout_for(placed, None), {"weights": placed.region})
    expected = placed.region.tensor(torch.uint8, (placed.bytes,)).clone()
    packs = memory.release({}, tmp_path / "packs", write_payload=True,
                           recovery_plan=plan)
    assert set(packs) == {"payload", "residual", "recovery_plan", "recovery_gap"}
    gap = packs["recovery_gap"]["size_bytes"]
    seconds: dict[str, float] = {}
    hydrated = memory.restore(seconds, safetensors=[str(f) for f in files], residual=packs["residual"]["path"],
                              recovery_plan=packs["recovery_plan"]["path"], recovery_gap=packs["recovery_gap"]["path"])
    assert hydrated["planned"] is True and hydrated["bytes"] == (4 + 2 + 5) * 64 * 2 and gap > 0
    assert torch.equal(placed.region.tensor(torch.uint8, (placed.bytes,)), expected)


def test_subtract_extents():
    assert subtract_extents([(0, 100)], [(10, 10), (50, 60)]) == [(0, 10), (20, 30)]
    assert subtract_extents([(0, 10), (20, 10)], []) == [(0, 10), (20, 10)]
    assert subtract_extents([(0, 10)], [(0, 10)]) == []
