"""coldsnap_vllm.placement on a torch module (no vLLM needed): parameters move into the ``weights``
region — every storage once, the same Parameter objects — and buffers stay where the model made them,
so the region holds exactly what vLLM's weight loaders fill (what a recovery restore refills)."""

import pytest

torch = pytest.importorskip("torch")

from coldsnap_vllm.placement import ALIGN, layout_for, place_model_in_region, planned_extents  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_regions")


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage
        self.norm = torch.nn.LayerNorm(8)
        self.register_buffer("cos_sin_cache", torch.arange(64, dtype=torch.float32))


def test_parameters_move_into_the_region_and_buffers_stay():
    model = Tiny()
    x = torch.tensor([1, 2, 3])
    expected = model.head(model.norm(model.embed(x)))
    embed, buffer = model.embed.weight, model.cos_sin_cache
    buffer_address = buffer.data_ptr()
    planned = planned_extents(model)

    placed = place_model_in_region(model)

    base, end = placed.region.base, placed.region.base + placed.region.mapped_bytes
    for name, parameter in model.named_parameters():
        assert base <= parameter.data_ptr() < end, name
    assert model.embed.weight is embed and model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert model.cos_sin_cache is buffer and model.cos_sin_cache.data_ptr() == buffer_address  # not moved
    # embed (shared with head), norm weight, norm bias: three storages, each 4 KiB-aligned, as planned
    assert {(t["offset"], t["length"]) for t in placed.tensors} == planned and len(planned) == 3
    assert all(t["offset"] % ALIGN == 0 for t in placed.tensors)
    assert torch.equal(model.head(model.norm(model.embed(x))), expected)
    layout = layout_for(placed, None)
    assert sum(t.length for t in layout.regions[0].tensors) == placed.bytes == 32 * 8 * 4 + 8 * 4 * 2
