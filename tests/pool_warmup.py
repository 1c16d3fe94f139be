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


def warm_up_inductor() -> None:
    """One tiny inductor compile before any rank is forked: its first compile in a process pays ~1.8 s
    of one-time set-up (modules imported, lowerings and pattern passes registered), which each
    compiled rank of each pool job then inherits instead of paying again. In-process (one compile
    thread), so no compile worker pool or thread is left running in the fork server; dynamo's state
    is reset afterwards, so the ranks start with no compiled code and no counts."""
    import torch._dynamo
    import torch._inductor.config

    with torch._inductor.config.patch(compile_threads=1):
        compiled = torch.compile(lambda x: (x.exp() * 2).sum())
        compiled(torch.randn(5, requires_grad=True)).backward()
    torch._dynamo.reset()


if torch.get_num_threads() == 1:
    warm_up_inductor()
