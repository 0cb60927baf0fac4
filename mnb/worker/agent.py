"""``python -m mnb.worker.agent``: torchrun that says how its ranks ended, and (``--loopback-stores``)
whose stores listen on loopback only.

How ranks ended: when torchrun's agent sees ranks fail it raises ``ChildFailedError``
with torchrun's own record of each (``ProcessFailure``: exit code, negative for a
signal, and pid).  This module writes that record as JSON into ``$MNB_EXITS_DIR``
(one file per agent: ``<host>-<pid>.json``, ``{"<global rank>": {"exitcode": -9,
"pid": 123}}``) before torchrun exits, so the controller reads how ranks ended from
data, not from torchrun's log text.

Loopback stores: torchrun's rendezvous store and the store it shares with the workers
(``MASTER_ADDR:MASTER_PORT``) are unauthenticated ``TCPStore`` servers that
listen on every interface: anyone who can reach the port can read and write
the keys the ranks rendezvous with.  A pool on one host needs none of that
reach, so the controller starts torchrun through this module, which hands
every store server a socket already bound to 127.0.0.1 (TCPStore's
``master_listen_fd``) and then runs torchrun's own ``main`` unchanged::

    python -m mnb.worker.agent --loopback-stores --standalone --local-addr=127.0.0.1 --nproc-per-node=2 \\
        -m mnb.worker --connect /tmp/mnb-pool-x/pool.json --device cpu

Several hosts (``--nnodes > 1``, ``%mnb start --ip``, Slurm) leave the stores as torchrun makes them.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from mnb.protocol import EXITS_DIR_ENV

LOOPBACK = "127.0.0.1"
LOOPBACK_FLAG = "--loopback-stores"


def _loopback_store_factory(store_class: Any) -> Any:
    """A drop-in for ``TCPStore`` whose servers listen on 127.0.0.1 only."""
    listening: list[socket.socket] = []  # kept alive: the store owns the fd, not the socket object

    def create(host_name: str, port: int = 0, *args: Any, **kwargs: Any) -> Any:
        is_master = kwargs.get("is_master", args[1] if len(args) > 1 else False)
        if is_master and kwargs.get("master_listen_fd") is None:
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((LOOPBACK, port or 0))
            server.listen(128)
            listening.append(server)
            port = server.getsockname()[1]
            kwargs["master_listen_fd"] = server.fileno()
            host_name = LOOPBACK
        return store_class(host_name, port, *args, **kwargs)

    return create


def write_exits(failures: dict[int, Any], folder: str | Path) -> Path:
    """Write torchrun's ``{global rank: ProcessFailure}`` as ``{rank: {"exitcode", "pid"}}`` JSON (atomically)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = {str(rank): {"exitcode": int(failure.exitcode), "pid": int(failure.pid)}
            for rank, failure in failures.items()}
    path = folder / f"{socket.gethostname()}-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    args = list(sys.argv[1:] if argv is None else argv)
    if LOOPBACK_FLAG in args:
        args.remove(LOOPBACK_FLAG)
        loopback_store = _loopback_store_factory(dist.TCPStore)
        dist.TCPStore = loopback_store  # the worker store (dynamic_rendezvous uses dist.TCPStore)
        c10d_rendezvous_backend.TCPStore = loopback_store  # the rendezvous store
    try:
        run.main(args)
    except ChildFailedError as failed:
        folder = os.environ.get(EXITS_DIR_ENV)
        if folder:
            try:
                write_exits(failed.failures, folder)
            except OSError as exc:  # the log still has torchrun's summary
                print(f"mnb agent: could not record how the ranks ended in {folder}: {exc}", file=sys.stderr)
        raise


if __name__ == "__main__":
    main()
