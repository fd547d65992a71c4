"""Passing tensors around a ring of ranks by point-to-point sends (METP, paper 002 Sec. 3.1): the one mechanism behind
ring attention (K/V blocks, `attention_ring`) and METP's MLP (weight shards, `metp_mlp`).

Each step starts one `torch.distributed.batch_isend_irecv` — send to the next rank, receive from the one before —
before the step's compute, and waits after it: the next block arrives while the current one is computed (double
buffering: two blocks live at a time). In backward the gradients of the travelling blocks travel with them: a rank
computes its block's share into a fresh buffer while the previous ranks' sum arrives, adds the two and passes the sum
on (`carry`); after the last step each sum is sent home (`send_home`). On gloo (tests) and NCCL alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


@dataclass
class Ring:
    """`size` ranks in ring order (`peers`: their global ranks; `group` the process group holding them), this rank at
    position `rank`."""

    size: int
    rank: int
    peers: tuple[int, ...]
    group: Any = None

    def source(self, step: int) -> int:
        """Position whose block this rank holds after `step` steps."""
        return (self.rank - step) % self.size

    def exchange(self, send: list[Tensor], recv: list[Tensor], to: int = 1) -> list:
        """Start sending `send` to position rank + `to` and receiving `recv` from rank − `to` (one batch); the
        requests to `wait` on."""
        import torch.distributed as dist

        if not send and not recv:
            return []
        nxt, prv = self.peers[(self.rank + to) % self.size], self.peers[(self.rank - to) % self.size]
        ops = [dist.P2POp(dist.isend, t, nxt, group=self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, prv, group=self.group) for t in recv]
        return dist.batch_isend_irecv(ops)

    def send_home(self, carry: list[Tensor], steps: int) -> list[Tensor]:
        """After `steps` steps this rank holds position rank − (steps − 1)'s block: send its gradient sums there and
        receive this rank's own from rank + steps − 1."""
        import torch

        if steps <= 1:
            return carry
        home = [torch.empty_like(t) for t in carry]
        wait(self.exchange(carry, home, to=-(steps - 1)))
        return home


def wait(requests: list) -> None:
    for request in requests:
        request.wait()
