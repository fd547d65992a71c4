"""Run by test_launch under lstune's launcher, ending as the CLI does (lstune.cli.app.main): rank 0 alone refuses
(a UserError) in the middle of the steps, while rank 1 goes on into a collective and waits there for it."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from lstune.cli import app as cli

    def steps(args, prog_name, standalone_mode):
        import torch
        import torch.distributed as dist

        from lstune.errors import DataError
        from lstune.parallel.launch import detect_launch_env, init_distributed

        env = detect_launch_env()
        init_distributed(env)
        if env.rank == 0:
            raise DataError("rank 0's sample is refused: fix the data.")
        dist.all_reduce(torch.zeros(1))
        return 0

    cli.app = steps  # the CLI's own ending (exit codes, messages, a launched rank's exit) around this "command"
    cli.main(sys.argv[1:])
