"""kernels/options.py: the cute backend's tuning, read from the environment once and validated; and the QuACK
adapter's version check, which runs before QuACK is imported (so it is testable without QuACK or a GPU)."""

from __future__ import annotations

import importlib
import importlib.metadata
import pathlib
import re
import sys

import pytest
import torch
from sonic_megatron.kernels import options
from sonic_megatron.kernels.options import KernelOptions, TileSpec, kernel_options, set_kernel_options

KERNELS = pathlib.Path(options.__file__).resolve().parent


@pytest.fixture
def fresh_options(monkeypatch):
    """Nothing resolved yet (as in a new process); the resolved options are restored afterwards."""
    monkeypatch.setattr(options, "_resolved", None)
    for name in options.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_from_an_empty_environment():
    got = KernelOptions.from_env({"XDG_CACHE_HOME": "/cache"})
    assert got == KernelOptions(tuning="heuristic", tiles=())


def test_values_from_the_environment_are_parsed():
    env = {
        "SONIC_MEGATRON_CUTE_TUNING": "autotune",
        "SONIC_MEGATRON_CUTE_TILES": " dx=P192x128c12, dw1=C256x192 ,",
        "SONIC_MEGATRON_CACHE_DIR": "",  # empty: unset
    }
    got = KernelOptions.from_env(env)
    assert got.tuning == "autotune"
    assert got.tiles == (("dw1", TileSpec(False, 256, 192, 2, 1)), ("dx", TileSpec(True, 192, 128, 1, 2)))


@pytest.mark.parametrize(
    "name, value, message, shown",
    [
        ("SONIC_MEGATRON_CUTE_TUNING", "fast", "SONIC_MEGATRON_CUTE_TUNING must be one of ('heuristic', ", "fast"),
        ("SONIC_MEGATRON_CUTE_TILES", "dx=Q128x128", "SONIC_MEGATRON_CUTE_TILES: a tile must look like", "Q128x128"),
        ("SONIC_MEGATRON_CUTE_TILES", "dx=C128x128c31", "SONIC_MEGATRON_CUTE_TILES: a tile must look", "C128x128c31"),
        ("SONIC_MEGATRON_CUTE_TILES", "fc1=C128x128", "SONIC_MEGATRON_CUTE_TILES: GEMM name must be one of", "fc1"),
        ("SONIC_MEGATRON_CUTE_TILES", "C128x128", "SONIC_MEGATRON_CUTE_TILES: each item must look like", "C128x128"),
    ],
)
def test_bad_values_name_the_variable_and_the_value(name, value, message, shown):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        KernelOptions.from_env({name: value})
    assert f"got {shown!r}" in str(info.value)


def test_options_in_code_are_validated_too():
    with pytest.raises(ValueError, match=r"KernelOptions.tuning \(SONIC_MEGATRON_CUTE_TUNING\) .* got 'tuned'"):
        KernelOptions(tuning="tuned")
    with pytest.raises(ValueError, match=r"KernelOptions.tiles \(SONIC_MEGATRON_CUTE_TILES\).*got \('fc2'"):
        KernelOptions(tiles={"fc2": TileSpec(False, 128, 256)})
    with pytest.raises(ValueError, match=r"KernelOptions.tiles \(SONIC_MEGATRON_CUTE_TILES\): a tile must look"):
        KernelOptions(tiles="up=128x256")
    as_text = KernelOptions(tiles="up=C128x256,dh=P128x128c21")
    as_map = KernelOptions(tiles={"dh": TileSpec(True, 128, 128), "up": TileSpec(False, 128, 256)})
    assert as_text == as_map and hash(as_text) == hash(as_map)  # normalized: the tile configs' memo key
    with pytest.raises(TypeError, match="set_kernel_options: options must be a KernelOptions, got dict"):
        set_kernel_options({"tuning": "default"})


def test_resolved_once_at_first_use(fresh_options):
    fresh_options.setenv("SONIC_MEGATRON_CUTE_TUNING", "default")
    fresh_options.setenv("SONIC_MEGATRON_CUTE_TILES", "up=P128x128")
    first = kernel_options()
    assert first.tuning == "default" and first.tiles == (("up", TileSpec(True, 128, 128)),)
    fresh_options.setenv("SONIC_MEGATRON_CUTE_TUNING", "autotune")  # too late: already resolved
    fresh_options.setenv("SONIC_MEGATRON_CUTE_TILES", "not a tile")  # not read again, so no error either
    assert kernel_options() is first
    explicit = KernelOptions(tuning="autotune")
    set_kernel_options(explicit)  # the explicit way to change them
    assert kernel_options() is explicit


def test_a_bad_variable_fails_at_first_use(fresh_options):
    fresh_options.setenv("SONIC_MEGATRON_CUTE_TUNING", "Heuristic")
    with pytest.raises(ValueError, match="SONIC_MEGATRON_CUTE_TUNING must be one of .* got 'Heuristic'"):
        kernel_options()


def test_the_old_cache_folder_variable_names_quacks_own():
    """QuACK's compile cache is QuACK's to place (QUACK_CACHE_DIR): the plugin writes no environment variable."""
    with pytest.raises(ValueError, match="SONIC_MEGATRON_CACHE_DIR is no longer read.*QUACK_CACHE_DIR"):
        KernelOptions.from_env({"SONIC_MEGATRON_CACHE_DIR": "/kernels"})


def test_no_environment_reads_outside_option_resolution():
    """Launch paths read ``kernel_options()``, never the environment: in kernels/ only options.py (resolution)
    touches os.environ (the QuACK adapter leaves QuACK's variables to the user)."""
    readers = {
        str(path.relative_to(KERNELS))
        for path in KERNELS.rglob("*.py")
        if re.search(r"os\.environ|getenv", path.read_text())
    }
    assert readers == {"options.py"}, readers


# ----------------------------------------------------------------------------------------------------------
# The QuACK adapter's version check (runs first when the cute backend is imported)
# ----------------------------------------------------------------------------------------------------------


def _forget_cute(monkeypatch) -> None:
    """The next import of kernels.cute runs its code again (restored afterwards, e.g. on a GPU machine)."""
    monkeypatch.delattr(sys.modules["sonic_megatron.kernels"], "cute", raising=False)
    for name in ("sonic_megatron.kernels.cute", "sonic_megatron.kernels.cute.quack_adapter"):
        if name in sys.modules:
            monkeypatch.delitem(sys.modules, name)


def _import_adapter(monkeypatch, versions: dict[str, str]):
    """Import kernels.cute.quack_adapter afresh with ``versions`` as the installed distributions."""

    def version(name):
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    _forget_cute(monkeypatch)
    return importlib.import_module("sonic_megatron.kernels.cute.quack_adapter")


@pytest.mark.parametrize(
    "versions, message",
    [
        (
            {"quack-kernels": "0.4.1", "nvidia-cutlass-dsl": "4.4.2"},
            "quack-kernels 0.4.1 is installed; the cute backend supports quack-kernels>=0.6.5,<0.7, "
            "nvidia-cutlass-dsl>=4.7,<4.9 (the hopper extra); found: quack-kernels 0.4.1, nvidia-cutlass-dsl 4.4.2",
        ),
        (
            {"quack-kernels": "0.7.0", "nvidia-cutlass-dsl": "4.7.1"},
            "quack-kernels 0.7.0 is installed; the cute backend supports quack-kernels>=0.6.5,<0.7",
        ),
        (
            {"quack-kernels": "0.6.5", "nvidia-cutlass-dsl": "4.9.0"},
            "nvidia-cutlass-dsl 4.9.0 is installed; the cute backend supports quack-kernels>=0.6.5,<0.7, "
            "nvidia-cutlass-dsl>=4.7,<4.9 (the hopper extra); found: quack-kernels 0.6.5, nvidia-cutlass-dsl 4.9.0",
        ),
        (
            {"nvidia-cutlass-dsl": "4.7.1"},
            "quack-kernels is not installed; the cute backend supports quack-kernels>=0.6.5,<0.7, "
            "nvidia-cutlass-dsl>=4.7,<4.9 (the hopper extra); found: quack-kernels not installed",
        ),
    ],
)
def test_other_quack_versions_are_refused(monkeypatch, versions, message):
    with pytest.raises(ImportError, match=re.escape(message)):
        _import_adapter(monkeypatch, versions)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path past the version check")
@pytest.mark.parametrize(
    "versions",
    [
        {"quack-kernels": "0.6.5", "nvidia-cutlass-dsl": "4.7.0"},
        {"quack-kernels": "0.6.9.post1", "nvidia-cutlass-dsl": "4.8.1"},
    ],
)
def test_supported_versions_pass_the_check(monkeypatch, versions):
    with pytest.raises(ImportError, match="the cute backend needs a CUDA build of torch and a GPU"):
        _import_adapter(monkeypatch, versions)


def test_auto_backend_falls_back_saying_why(monkeypatch):
    """A refused version reaches the user through cute_unavailable_reason (``auto`` warns and uses torch)."""
    from sonic_megatron.kernels import interface

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0.1")
    _forget_cute(monkeypatch)
    reason = interface.cute_unavailable_reason(torch.device("cuda"))
    assert "quack-kernels 0.0.1 is installed; the cute backend supports quack-kernels>=0.6.5,<0.7" in reason
