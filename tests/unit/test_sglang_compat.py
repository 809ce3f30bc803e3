"""coldsnap's SGLang plugin against the releases it supports: every symbol it looks up exists in the
0.5.17 and 0.5.23 wheels (their API surfaces, read from the wheels by scripts/api-surface.py). SGLang
0.5.17 runs the plugin's hooks inside its real modules in tests/integration/test_sglang_hooks.py."""

import json
from pathlib import Path

import pytest

from coldsnap_sglang import compat

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SURFACES = ("0.5.17", "0.5.23")  # the first and the last supported release


def surface(version: str) -> dict[str, bool]:
    return json.loads((FIXTURES / f"sglang-{version}-surface.json").read_text())["symbols"]


def test_the_recorded_surfaces_are_the_supported_range_and_cover_every_probed_symbol():
    recorded = sorted(p.name.split("-")[1] for p in FIXTURES.glob("sglang-*-surface.json"))
    assert recorded == sorted(SURFACES), "a recorded surface without its test (or the reverse)"
    for version in SURFACES:
        assert set(surface(version)) == set(compat.PROBED), f"re-record {version}: scripts/api-surface.py"
        assert compat.supported(version)
    (a, b, c), (x, y, z) = compat.SUPPORTED
    assert (a, b, c) == (0, 5, 17) and (x, y, z - 1) == (0, 5, 23), "record the new ends of the supported range"


@pytest.mark.parametrize("version", SURFACES)
def test_every_hook_target_exists_in_the_wheel(version):
    missing = [symbol for symbol, found in surface(version).items() if not found]
    assert not missing, f"SGLang {version} lacks {missing}: those features would be disabled there"
