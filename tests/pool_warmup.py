"""Imported once by the fork server of the test session's pools (tests/conftest.py): every training
run logs its MFU against the CPU's peak FLOP/s, which `peak_flops` measures once per process
(~0.2 s of one core). Measured here, before any rank is forked, each rank of each pool job inherits
it instead of measuring it again; the suite runs a few hundred such jobs."""

import torch

from shardwise.train.metrics import peak_flops

# A process that forks must not have started torch's worker threads: measured only on one thread,
# as the session runs (OMP_NUM_THREADS=1) unless the developer asked for more.
if torch.get_num_threads() == 1:
    peak_flops(torch.device("cpu"), torch.float32)
