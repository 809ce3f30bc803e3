"""benchmarks/results/ stays navigable and what is written from it stays current (issue 63): one folder per run
named YYYY-MM-DD-ENGINE-MACHINE-TOPIC with a README, no loose files, every figures.json well formed, and the
results index, docs/status.md's tables and the README's measured table as scripts/docs-results.py writes them."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _docs_results():
    """scripts/docs-results.py as a module: the test compares with exactly the text it writes."""
    spec = importlib.util.spec_from_file_location("docs_results", ROOT / "scripts" / "docs-results.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


DOCS_RESULTS = _docs_results()
FOLDERS = sorted(path for path in RESULTS.iterdir() if path.is_dir())


def test_only_run_folders_and_the_index_at_the_top():
    loose = [path.name for path in RESULTS.iterdir() if path.is_file() and path.name != "README.md"]
    assert not loose, f"loose files in benchmarks/results/ (move each into its run's folder): {loose}"
    assert FOLDERS


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda path: path.name)
def test_every_folder_is_named_for_its_run_and_has_a_readme(folder):
    assert DOCS_RESULTS.NAME.match(folder.name), f"{folder.name}: want YYYY-MM-DD-ENGINE-MACHINE-TOPIC"
    readme = folder / "README.md"
    assert readme.is_file(), f"{folder.name} has no README.md"
    assert readme.read_text().startswith("# "), f"{folder.name}/README.md: its first line is its title (# ...)"


@pytest.mark.parametrize("figures", sorted(RESULTS.glob("*/figures.json")), ids=lambda path: path.parent.name)
def test_every_figure_names_what_its_index_and_tables_need(figures):
    data = json.loads(figures.read_text())
    assert set(data) == {"commit", "recorded", "figures"}, figures
    required = {key for key, what in DOCS_RESULTS.FIGURE_KEYS.items() if what.startswith("* ")}
    for figure in data["figures"]:
        assert required <= set(figure) <= set(DOCS_RESULTS.FIGURE_KEYS), figure
        if "cold_start" in figure:
            assert isinstance(figure.get("cold_starts"), int) and figure["cold_starts"] >= 1, \
                f"{figures.parent.name}: a ratio names how many cold starts it divides by"
        if figure.get("headline"):
            assert "cold_start" in figure, f"{figures.parent.name}: a headline figure has a cold start to compare with"
            if figures.parent.name[:10] >= "2026-12-08":
                assert figure["cold_starts"] >= 3, f"{figures.parent.name}: a headline ratio divides by ≥ 3 cold starts"


@pytest.mark.parametrize("page", ["benchmarks/results/README.md", "docs/status.md", "README.md"])
def test_generated_pages_are_current(page):
    expected = DOCS_RESULTS.rendered()[ROOT / page]
    assert (ROOT / page).read_text() == expected, f"{page} is stale: python scripts/docs-results.py"


def test_every_run_folder_is_in_the_index():
    index = (RESULTS / "README.md").read_text()
    missing = [folder.name for folder in FOLDERS if f"({folder.name}/)" not in index]
    assert not missing, missing


def test_a_new_run_lands_in_a_folder_named_for_it(tmp_path):
    import datetime

    from benchmarks.common import cold_start_figure, run_folder, write_figures

    folder = run_folder("vllm", "h100-early-restore", day=datetime.date(2026, 12, 8), results=tmp_path)
    assert folder.name == "2026-12-08-vllm-h100-early-restore" and (folder / "README.md").read_text().startswith("# ")
    figure = cold_start_figure("8B", "restore", [1.4, 1.3, 1.5], [60.0, 70.0, 65.0])
    assert figure["value"] == 1.4 and figure["cold_start"] == 65.0 and figure["cold_starts"] == 3
    data = json.loads(write_figures(folder, [figure]).read_text())
    assert set(data) == {"commit", "recorded", "figures"}
    with pytest.raises(ValueError, match="YYYY-MM-DD-ENGINE-MACHINE-TOPIC"):
        run_folder("vllm", "laptop-run", results=tmp_path)
