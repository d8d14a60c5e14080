"""The %%ranks cell magic: run a notebook cell on every rank of a Cluster (runs in the kernel).

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
``sys.argv[1:]``. The values are the ranks' exit codes. ``%ranks --script train.py`` (one line;
or ``%%ranks --script train.py`` over a cell of comments) runs the file instead, as
``cluster.run_script("train.py")``: the script's folder first on ``sys.path``, as for a cell
the working folder (see ``isolation``).
"""
from __future__ import annotations

import shlex

from IPython.core import magic_arguments
from IPython.core.magic import Magics, line_cell_magic, magics_class

from .cluster import current_cluster
from ..errors import ClusterError


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
    @magic_arguments.argument("file", nargs="?", default=None,
                              help="with --script: a script file to run instead of the cell")
    @line_cell_magic
    def ranks(self, line, cell=None):
        """Run the cell body on every rank (see ``dpcourse.pool.kernel.magic``)."""
        args = magic_arguments.parse_argstring(self.ranks, line)
        if args.file and not args.script:
            raise ClusterError(f"%ranks got a file name ({args.file}) without --script: "
                               f"%ranks --script {args.file} runs it as torchrun would")
        if cell is None and not args.file:
            raise ClusterError("%ranks on one line runs a script file: %ranks --script train.py; "
                               "for code written in the cell, use %%ranks")
        if args.cluster:
            cluster = self.shell.user_ns.get(args.cluster)
            if cluster is None:
                raise ClusterError(f"no kernel variable named {args.cluster!r} holds a Cluster")
        else:
            cluster = current_cluster(closed=True)   # a shut-down one says how to start it again
            if cluster is None:
                raise ClusterError("no running cluster: start one first, e.g. "
                                   "cluster = dpc.Cluster(world_size=2)")
        kwargs = {} if args.timeout is None else {"timeout": args.timeout}
        if args.script:
            argv = args.argv
            if len(argv) >= 2 and argv[0] == argv[-1] and argv[0] in "'\"":
                argv = argv[1:-1]  # IPython's argument splitter keeps the quotes of --argv '...'
            if args.file:
                if any(line.strip() and not line.strip().startswith("#") for line in (cell or "").splitlines()):
                    raise ClusterError(f"%%ranks --script {args.file} runs that file, not the cell's code: "
                                       "drop the code (comments may stay), or drop the file name to run "
                                       "the cell")
                values = cluster.run_script(args.file, *shlex.split(argv), **kwargs)
            else:
                values = cluster.run_script_source(cell, *shlex.split(argv), **kwargs)
        else:
            values = cluster.run_cell(cell, **kwargs)
        if args.out:
            self.shell.user_ns[args.out] = values
        if not args.quiet and not args.script:
            for rank, value in enumerate(values):
                if value is not None:
                    print(f"[rank {rank}] Out: {value!r}")
