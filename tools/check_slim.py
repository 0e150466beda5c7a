"""Check that slim packages never import torch, transformers or vLLM.

Imports every module of each named package and runs every console script of
its distribution with ``--help`` (in-process), then fails if a heavy module
was imported. Run in an env without torch to make the check meaningful:
``python tools/check_slim.py laminar_common laminar_relay``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import io
import pkgutil
import sys

HEAVY = ("torch", "transformers", "vllm", "tokenizers")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("packages", nargs="+", help="import names, e.g. laminar_common")
    args = p.parse_args()
    for name in args.packages:
        pkg = importlib.import_module(name)
        for mod in pkgutil.walk_packages(pkg.__path__, prefix=f"{name}."):
            importlib.import_module(mod.name)
    scripts = [
        ep for ep in importlib.metadata.entry_points(group="console_scripts")
        if ep.value.split(".")[0] in args.packages
    ]
    for ep in scripts:
        main_fn = ep.load()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main_fn(["--help"])
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
    print(f"imported {len(args.packages)} packages, ran {len(scripts)} CLIs with --help")
    if heavy:
        print(f"FAIL: heavy modules imported: {heavy}")
        return 1
    print("ok: no torch/transformers/vllm/tokenizers imported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
