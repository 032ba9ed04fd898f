"""The few Megatron-LM files that ``pretrain_gpt.py`` needs beyond the megatron-core wheel, in one small
directory (default ``.mlm/``, about 100 KB) that travels with the repository to a GPU machine.

    python -m sonic_megatron.bench.megatron_lm SOURCE [--ref core_r0.19.0] [--dest .mlm]

SOURCE is a Megatron-LM checkout (files are copied from its work tree) or a git directory, bare or not (files
are read from ``--ref`` with ``git show``). What is copied:
    pretrain_gpt.py, gpt_builders.py, model_provider.py     the launcher (in no wheel)
    datasets_Makefile, datasets_helpers.cpp                 megatron/core/datasets/{Makefile,helpers.cpp}: the
                                                            wheel lacks the Makefile with which pretrain_gpt.py
                                                            compiles its dataset helpers at start;
                                                            ``install_dataset_sources`` puts them in place
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

# name in the directory -> path in Megatron-LM
FILES = {
    "pretrain_gpt.py": "pretrain_gpt.py",
    "gpt_builders.py": "gpt_builders.py",
    "model_provider.py": "model_provider.py",
    "datasets_Makefile": "megatron/core/datasets/Makefile",
    "datasets_helpers.cpp": "megatron/core/datasets/helpers.cpp",
}
DATASET_SOURCES = {"datasets_Makefile": "Makefile", "datasets_helpers.cpp": "helpers.cpp"}
DEFAULT_REF = "core_r0.19.0"


def fetch(source: str, dest: str, ref: str = DEFAULT_REF) -> list[str]:
    """Copy ``FILES`` from a Megatron-LM checkout or git directory ``source`` into ``dest``; returns the
    written paths. A checkout's work tree wins over ``ref`` (pass a git directory to pick a branch)."""
    os.makedirs(dest, exist_ok=True)
    from_tree = os.path.isfile(os.path.join(source, "pretrain_gpt.py"))
    if not from_tree and not _is_git_dir(source):
        raise ValueError(
            f"source: {source!r} is neither a Megatron-LM checkout (no pretrain_gpt.py) nor a git directory"
        )
    written = []
    for name, path in FILES.items():
        out = os.path.join(dest, name)
        if from_tree:
            shutil.copyfile(os.path.join(source, path), out)
        else:
            blob = subprocess.run(["git", "-C", source, "show", f"{ref}:{path}"], capture_output=True, check=False)
            if blob.returncode != 0:
                raise ValueError(f"ref: {ref}:{path} not found in {source}: {blob.stderr.decode().strip()}")
            with open(out, "wb") as f:
                f.write(blob.stdout)
        written.append(out)
    return written


def _is_git_dir(path: str) -> bool:
    probe = subprocess.run(["git", "-C", path, "rev-parse", "--git-dir"], capture_output=True, check=False)
    return probe.returncode == 0


def wheel_datasets_dir() -> str | None:
    """megatron-core's ``megatron/core/datasets`` directory of this Python, or None if it does not import."""
    import importlib.util

    spec = importlib.util.find_spec("megatron.core.datasets")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def install_dataset_sources(mlm_dir: str, datasets_dir: str | None = None) -> list[str]:
    """Copy ``datasets_Makefile`` / ``datasets_helpers.cpp`` of ``mlm_dir`` into megatron-core's datasets
    directory where that lacks them (pretrain_gpt.py runs ``make`` there at start); returns what it
    installed. Missing sources are left to Megatron's own error."""
    datasets_dir = datasets_dir or wheel_datasets_dir()
    if datasets_dir is None:
        return []
    installed = []
    for name, target in DATASET_SOURCES.items():
        src, dst = os.path.join(mlm_dir, name), os.path.join(datasets_dir, target)
        if not os.path.exists(dst) and os.path.isfile(src):
            shutil.copyfile(src, dst)
            installed.append(dst)
    return installed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sonic_megatron.bench.megatron_lm", description=__doc__.split("\n")[0]
    )
    parser.add_argument("source", help="Megatron-LM checkout or git directory")
    parser.add_argument("--ref", default=DEFAULT_REF, help="branch/commit when SOURCE is a git directory")
    parser.add_argument("--dest", default=".mlm", help="output directory")
    args = parser.parse_args(argv)
    try:
        written = fetch(args.source, args.dest, args.ref)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    total = sum(os.path.getsize(p) for p in written)
    print(f"wrote {len(written)} files, {total / 1024:.0f} KiB, to {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
