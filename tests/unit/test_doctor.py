"""Host facts that do not need the host: parsing the NVIDIA driver version (coldsnap.host)."""

from coldsnap.host import nvidia_kernel_driver


def test_open_and_proprietary_module_versions(tmp_path):
    samples = {
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U22)  Thu Oct 2 2025\n"
        "GCC version:  gcc version 12.3.0\n": "580.159.04",
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n": "550.54.15",
        "garbage\n": None,
    }
    for index, (text, expected) in enumerate(samples.items()):
        path = tmp_path / f"version{index}"
        path.write_text(text)
        assert nvidia_kernel_driver(path) == expected
    assert nvidia_kernel_driver(tmp_path / "absent") is None
