"""A benchmark's --define: kernel variants built with more -D options (shared by the scripts here)."""
from __future__ import annotations

import argparse


def add_define_argument(ap: argparse.ArgumentParser) -> None:
    """--define NAME=VALUE, repeatable: one more -D option for the kernels, or the host's value of
    NAME replaced (cuda_plan.define_options)."""
    ap.add_argument("--define", action="append", default=[],
                    help="NAME=VALUE: one more -D option for the kernels, or the host's value of NAME "
                         "replaced (a variant to time)")


def apply_defines(args: argparse.Namespace) -> None:
    """Build every kernel compiled from now on with args.define (raises on a bad one, changing nothing)."""
    from gpu_engine.backends import cuda_module

    cuda_module.add_defines(args.define)
