"""The %%ranks cell magic: run a notebook cell on every rank of a Cluster.

    %load_ext dpcourse
    cluster = dpc.Cluster(world_size=4)

    %%ranks
    t = torch.tensor([rank])        # rank, world_size, device, torch, dist are predefined
    dist.all_reduce(t)
    t                               # the last expression is shown per rank

Variables assigned in a %%ranks cell stay on the ranks for later %%ranks cells (until the
ranks are restarted after a failure). ``-o NAME`` stores the per-rank values of the last
line in the kernel variable NAME; ``--timeout S`` limits the cell; ``--cluster NAME``
picks a cluster other than the most recently started one.

``%%ranks --script`` runs the cell as a torchrun-style script instead (see
``Cluster.run_script``): as ``__main__``, in a fresh namespace, with torchrun's environment
and no process group, so it calls ``init_process_group`` itself; ``--argv "..."`` sets
``sys.argv[1:]``. The values are the ranks' exit codes.
"""
from __future__ import annotations

import shlex

from IPython.core import magic_arguments
from IPython.core.magic import Magics, cell_magic, magics_class

from .cluster import current_cluster
from .errors import ClusterError


@magics_class
class RanksMagics(Magics):
    @magic_arguments.magic_arguments()
    @magic_arguments.argument("--cluster", "-c", default=None, help="kernel variable holding the Cluster")
    @magic_arguments.argument("--timeout", "-t", type=float, default=None, help="seconds before RankTimeout")
    @magic_arguments.argument("--out", "-o", default=None, help="kernel variable for the per-rank values")
    @magic_arguments.argument("--quiet", "-q", action="store_true", help="do not print the per-rank values")
    @magic_arguments.argument("--script", "-s", action="store_true",
                              help="run the cell as a torchrun-style script (__main__, no process group)")
    @magic_arguments.argument("--argv", default="", help="with --script: the script's arguments, one string")
    @cell_magic
    def ranks(self, line, cell):
        """Run the cell body on every rank (see ``dpcourse.pool.magic``)."""
        args = magic_arguments.parse_argstring(self.ranks, line)
        if args.cluster:
            cluster = self.shell.user_ns.get(args.cluster)
            if cluster is None:
                raise ClusterError(f"no kernel variable named {args.cluster!r} holds a Cluster")
        else:
            cluster = current_cluster()
            if cluster is None:
                raise ClusterError("no running cluster: start one first, e.g. "
                                   "cluster = dpc.Cluster(world_size=2)")
        kwargs = {} if args.timeout is None else {"timeout": args.timeout}
        if args.script:
            argv = args.argv
            if len(argv) >= 2 and argv[0] == argv[-1] and argv[0] in "'\"":
                argv = argv[1:-1]  # IPython's argument splitter keeps the quotes of --argv '...'
            values = cluster.run_script_source(cell, *shlex.split(argv), **kwargs)
        else:
            values = cluster.run_cell(cell, **kwargs)
        if args.out:
            self.shell.user_ns[args.out] = values
        if not args.quiet and not args.script:
            for rank, value in enumerate(values):
                if value is not None:
                    print(f"[rank {rank}] Out: {value!r}")
