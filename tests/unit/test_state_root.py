"""The state root forgets artifacts that were deleted (coldsnap.activation.state.forget_removed_artifacts)."""

import os

from coldsnap.activation.state import STANDBY_RECORD, forget_removed_artifacts


def _restored_state(root, name, artifact_images):
    images = root / name / "port-8000" / "images"
    images.mkdir(parents=True)
    (root / name / "port-8000" / "logs").mkdir()
    os.symlink(artifact_images / "pages-1.img", images / "pages-1.img")
    return root / name


def test_the_state_of_a_deleted_artifact_goes_and_the_rest_stays(tmp_path):
    root = tmp_path / "state"
    kept_images, gone_images = tmp_path / "kept" / "images", tmp_path / "gone" / "images"
    for images in (kept_images, gone_images):
        images.mkdir(parents=True)
        (images / "pages-1.img").write_bytes(b"x")
    kept = _restored_state(root, "0123456789abcdef", kept_images)
    gone = _restored_state(root, "fedcba9876543210", gone_images)
    standby = _restored_state(root, "00000000000000aa", gone_images)
    (standby / STANDBY_RECORD).write_text("{}")
    (root / "records").mkdir()
    (root / "criu-check.json").write_text("{}")
    (gone_images / "pages-1.img").unlink()  # the artifact was deleted

    assert forget_removed_artifacts(root) == [gone.name]
    assert kept.exists() and standby.exists() and not gone.exists()
    assert (root / "records").exists() and (root / "criu-check.json").exists()
    assert forget_removed_artifacts(root) == []
    assert forget_removed_artifacts(tmp_path / "no-such-root") == []
