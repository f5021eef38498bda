"""The host-sync counter counts reads of tensor values, not tensor arithmetic, and names the site."""

import torch

from agentspec.bench.syncs import HostSyncs
from agentspec.verify import greedy_verify


def test_counts_value_reads_only():
    t = torch.arange(6.0)
    with HostSyncs() as syncs:
        u = (t * 2 + 1).softmax(0)  # device work: no read
        assert syncs.count == 0
        u[0].item()
        u.tolist()
        if u.sum() > 0:  # __bool__
            pass
        int(t[1]), float(t[2]), [0, 1, 2][t[1].long()]  # __int__, __float__, __index__
        t.cpu(), t.numpy()
    assert syncs.count == 8
    assert sum(syncs.where.values()) == 8


def test_names_the_agentspec_line_that_read():
    logits = torch.zeros(3, 10)
    logits[:, 4] = 1.0
    with HostSyncs() as syncs:
        greedy_verify(torch.tensor([4, 4]), logits)
    assert syncs.count >= 1
    assert all(site.startswith("verify.py:") for site in syncs.where), syncs.where
