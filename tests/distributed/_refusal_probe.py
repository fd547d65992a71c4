"""Run by test_refusals under lstune's launcher, through the CLI's own ending (lstune.cli.app.main): rank 0 alone
refuses (a UserError), at an agreement point or in the middle of the steps, while rank 1 goes on to a collective."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from lstune.cli import app as cli

    where = sys.argv[1]

    def command(args, prog_name, standalone_mode):
        import torch
        import torch.distributed as dist

        from lstune.errors import DataError
        from lstune.parallel.comm import Communicator
        from lstune.parallel.launch import detect_launch_env, init_distributed

        env = detect_launch_env()
        init_distributed(env)

        def check():
            if env.rank == 0:
                raise DataError("rank 0's shard is refused: fix the data.")

        if where == "agreed":
            Communicator.of().agreed(check)
        else:
            check()
        dist.all_reduce(torch.zeros(1))  # where rank 1 waits for a rank 0 that has left
        return 0

    cli.app = command
    cli.main(sys.argv[2:])
