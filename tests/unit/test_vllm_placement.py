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


class Draft(torch.nn.Module):
    """A smaller model placed after another in the same region (a speculative draft beside its target)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 4)
        self.head = torch.nn.Linear(4, 32, bias=False)


def _outputs(target: Tiny, draft: Draft) -> tuple:
    x = torch.tensor([1, 2, 3])
    return target.head(target.norm(target.embed(x))), draft.head(draft.embed(x))


def test_a_draft_is_placed_after_its_target_in_the_same_region_and_one_pack_holds_both(tmp_path):
    from coldsnap.agent.placement import (PackDoesNotFit, append_model_to_region, check_pack_fits, pack_end,
                                          place_weights)
    from coldsnap.hydrate import write_pack_from_regions
    from coldsnap.memory import release_all
    from coldsnap.payload import NativePack

    torch.manual_seed(0)
    target, draft = Tiny(), Draft()
    expected = _outputs(target, draft)
    big = torch.nn.Linear(1024, 1024)  # 4 MiB: more than the region's chunk rounding left after the target
    with pytest.raises(ValueError, match="bytes left after the first model, this model needs"):
        append_model_to_region(big, place_model_in_region(Tiny()), prefix="draft.")  # no room reserved: refused, nothing moved
    assert big.weight.device.type == "cpu" and not big.weight.is_meta
    release_all()
    placed = place_model_in_region(target, reserve_bytes=1 << 20)
    target_end = placed.end
    planned = planned_extents(draft, target_end)
    own = append_model_to_region(draft, placed, prefix="draft.")
    assert {t["name"] for t in own.tensors} == {"draft.embed.weight", "draft.head.weight"}
    assert {(t["offset"], t["length"]) for t in own.tensors} == planned and min(planned)[0] == target_end
    assert len(placed.tensors) == 3 + 2 and placed.bytes == 32 * 8 * 4 + 8 * 4 * 2 + 2 * 32 * 4 * 4
    assert placed.end == own.end > target_end and placed.region.mapped_bytes >= own.end
    for parameter in draft.parameters():
        assert placed.region.base + target_end <= parameter.data_ptr() < placed.region.base + own.end
    assert all(torch.equal(a, b) for a, b in zip(_outputs(target, draft), expected))

    written = write_pack_from_regions(tmp_path, layout_for(placed, None), {"weights": placed.region})
    pack = NativePack.open(written.path)
    assert pack_end(pack) == max(t["offset"] + t["length"] for t in placed.tensors)
    check_pack_fits(pack, planned_extents(Tiny()), end=target_end)  # the target's window, and a draft after it
    check_pack_fits(pack, planned, start=target_end)  # the draft's window
    with pytest.raises(PackDoesNotFit, match="does not fit this model"):
        check_pack_fits(pack, planned_extents(Tiny()))  # the whole pack is more than the target
    release_all()

    # A fresh process starting both from that pack: the target's placement hydrates the whole pack, the
    # draft's parameters are rebound to the bytes already there (nothing copied from the fresh draft).
    import logging

    target, draft = Tiny(), Draft()
    placed = place_weights(target, pack, "native", logging.getLogger("test"), reserve_bytes=1 << 20, followed=True)
    own = append_model_to_region(draft, placed, prefix="draft.", copy=False)
    assert all(torch.equal(a, b) for a, b in zip(_outputs(target, draft), expected))
    release_all()
    (tmp_path / "target-only").mkdir()
    target_only = write_pack_from_regions(tmp_path / "target-only", layout_for(place_model_in_region(Tiny()), None),
                                          regions())
    with pytest.raises(PackDoesNotFit, match="written without one"):
        check_pack_fits(NativePack.open(target_only.path), planned_extents(Tiny()), end=target_end)


def regions():
    from coldsnap.memory import regions as live

    return live()
