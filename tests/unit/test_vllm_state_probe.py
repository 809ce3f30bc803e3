"""The state probe's fingerprints (benchmarks/vllm_state_probe.py), on CPU tensors: equal bytes give equal
digests, one changed element changes its block's, and small integer tensors are reported by value."""

import pytest

torch = pytest.importorskip("torch")

from benchmarks.vllm_state_probe import nonzero_entries, tensor_digest  # noqa: E402


def test_a_digest_tells_one_changed_element_and_not_a_copy():
    a = torch.arange(1000, dtype=torch.int32)
    b = a.clone()
    assert tensor_digest(a) == tensor_digest(b)
    b[17] += 1
    assert tensor_digest(a) != tensor_digest(b)
    assert tensor_digest(a.flip(0)) != tensor_digest(a)  # the same values elsewhere


def test_nonzero_entries_are_index_value_pairs_in_order_and_capped():
    semaphore_and_rows = torch.tensor([5, 0, 0, 2, 0, 9], dtype=torch.int32)  # split plans, then a semaphore
    assert nonzero_entries(semaphore_and_rows) == [[0, 5], [3, 2], [5, 9]]
    assert nonzero_entries(torch.zeros(4, dtype=torch.int64)) == []
    assert nonzero_entries(torch.ones(100, dtype=torch.int32), most=3) == [[0, 1], [1, 1], [2, 1]]


def test_the_fa3_builder_is_found_in_the_runners_attention_groups():
    from types import SimpleNamespace

    from benchmarks.vllm_state_probe import StateProbe, _fa3_builder

    fa2 = SimpleNamespace(aot_schedule=False)
    fa3 = SimpleNamespace(aot_schedule=True)
    runner = SimpleNamespace(attn_groups=[[SimpleNamespace(metadata_builders=[fa2])],
                                          [SimpleNamespace(metadata_builders=[fa2, fa3])]])
    assert _fa3_builder(runner) is fa3
    assert _fa3_builder(SimpleNamespace(attn_groups=[[SimpleNamespace(metadata_builders=[fa2])]])) is None
    assert _fa3_builder(None) is None
    worker = SimpleNamespace(model_runner=SimpleNamespace(attn_groups=[]))
    assert "error" in StateProbe.coldsnap_attention_schedule(worker)  # (no FA3: said so, nothing raised)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32,
                                   torch.uint32, torch.int64, torch.uint64])
def test_every_integer_dtype_is_digested_and_reported_by_value(dtype):
    """Every dtype the digest meets among a runner's tensors: torch has no nonzero for uint16/32/64 (the
    probe's call failed on vLLM's uint64 runner tensors), and an unsigned value above the signed range reads back
    as itself."""
    values = [0, 1, 0, 1] if dtype == torch.bool else [0, 5, 0, 7]
    tensor = torch.tensor(values).to(dtype)
    assert nonzero_entries(tensor) == ([[1, 1], [3, 1]] if dtype == torch.bool else [[1, 5], [3, 7]])
    assert len(tensor_digest(tensor)) == 1
    if dtype in (torch.uint16, torch.uint32, torch.uint64):
        bits = torch.iinfo(dtype).bits
        top = torch.tensor([0, -1], dtype={16: torch.int16, 32: torch.int32, 64: torch.int64}[bits]).view(dtype)
        assert nonzero_entries(top) == [[1, (1 << bits) - 1]]
