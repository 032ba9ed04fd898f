#!/usr/bin/env python3
"""Run ``python -m sonic_megatron ...`` with CPython's GIL switch interval set first (an experiment on the
comm thread: a thread waiting for the GIL otherwise waits up to 5 ms while another runs Python).

    torchrun --nproc_per_node 2 scripts/run_with_switch_interval.py 20 bench layer ...   # 20 microseconds
"""

import runpy
import sys

if __name__ == "__main__":
    sys.setswitchinterval(float(sys.argv[1]) * 1e-6)
    sys.argv = ["sonic_megatron", *sys.argv[2:]]
    runpy.run_module("sonic_megatron", run_name="__main__")
