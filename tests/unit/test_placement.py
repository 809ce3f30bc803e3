"""Placement ABI 2 (coldsnap.contracts.placement) and how the n580 template applies a placement."""

import os

import pytest

from coldsnap.contracts.base import ContractError, decode_document
from coldsnap.contracts.placement import PlacementRecord, PlacementRefused, check_placement_abi


def test_a_placement_sets_the_environment_and_the_serving_port(monkeypatch):
    from coldsnap.agent.template import apply_placement, entry

    monkeypatch.delenv("COLDSNAP_TEMPLATE_TEST", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    record = PlacementRecord(abi=2, serving_port=9001, visible_devices="1", env={"COLDSNAP_TEMPLATE_TEST": "1"})
    assert apply_placement(["python", "-m", "m", "--port", "8000", "--port=8001", "--portal", "x"], record) == [
        "python", "-m", "m", "--port", "9001", "--port=9001", "--portal", "x"]
    assert os.environ["COLDSNAP_TEMPLATE_TEST"] == "1" and os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert apply_placement(["x", "--port", "8000"], PlacementRecord(abi=2)) == ["x", "--port", "8000"]
    with pytest.raises(ValueError, match="cannot run '/bin/true' in the template's process"):
        entry(["/bin/true"])


def test_placements_a_template_cannot_take_are_refused():
    check_placement_abi(2, PlacementRecord(abi=2, env={"NCCL_SOCKET_IFNAME": "eth0"}))
    with pytest.raises(PlacementRefused, match="placement ABI 3 sent to a template of placement ABI 2"):
        check_placement_abi(2, PlacementRecord(abi=3))
    with pytest.raises(PlacementRefused, match="is not an environment variable name"):
        check_placement_abi(2, PlacementRecord(abi=2, env={"A=B": "1"}))
    # An ABI-1 template may map the NVIDIA userspace driver's libraries: only its captured driver takes it.
    check_placement_abi(1, PlacementRecord(abi=1), captured_driver="580.159.04", host_driver="580.159.04")
    for host in ("580.82.07", "610.1", None):
        with pytest.raises(PlacementRefused, match="captured under driver 580.159.04 cannot be restored under"):
            check_placement_abi(1, PlacementRecord(abi=1), captured_driver="580.159.04", host_driver=host)
    check_placement_abi(2, PlacementRecord(abi=2), captured_driver="580.159.04", host_driver="610.1")  # portable


@pytest.mark.parametrize("document, problem", [
    ({"abi": "2"}, "abi"),
    ({"abi": 2, "serving_port": 70000}, "serving_port"),
    ({"abi": 2, "visible_devices": "0; rm -rf"}, "visible_devices"),
    ({"abi": 2, "hosts": []}, "hosts"),
])
def test_placement_records_decode_strictly(document, problem):
    with pytest.raises(ContractError) as caught:
        decode_document(PlacementRecord, document, "placement")
    assert problem in str(caught.value)
