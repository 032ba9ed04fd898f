#!/usr/bin/env python3
"""Run ``python -m sonic_megatron ...`` with CPython's GIL switch interval set first, and optionally the comm
thread's policy changed (experiments on token_dispatch.comm.CommThread):

    torchrun --nproc_per_node 2 scripts/run_with_switch_interval.py 20 [--wait-for-thread] bench layer ...

20: the interval in microseconds (CommThread lowers it to SWITCH_INTERVAL_S anyway; this sets it for every
variant, from the start). --wait-for-thread: a caller that needs a queued collective sleeps until the thread
has issued it (CommThread.ISSUE_FROM_CALLER = False) instead of issuing it itself.
"""

import runpy
import sys

if __name__ == "__main__":
    sys.setswitchinterval(float(sys.argv[1]) * 1e-6)
    rest = sys.argv[2:]
    if rest and rest[0] == "--wait-for-thread":
        from sonic_megatron.token_dispatch.comm import CommThread

        CommThread.ISSUE_FROM_CALLER = False
        rest = rest[1:]
    sys.argv = ["sonic_megatron", *rest]
    runpy.run_module("sonic_megatron", run_name="__main__")
