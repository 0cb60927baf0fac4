"""``python -m mnb.worker.agent``: torchrun whose stores listen on loopback only.

torchrun's rendezvous store and the store it shares with the workers
(``MASTER_ADDR:MASTER_PORT``) are unauthenticated ``TCPStore`` servers that
listen on every interface: anyone who can reach the port can read and write
the keys the ranks rendezvous with.  A pool on one host needs none of that
reach, so the controller starts torchrun through this module, which hands
every store server a socket already bound to 127.0.0.1 (TCPStore's
``master_listen_fd``) and then runs torchrun's own ``main`` unchanged::

    python -m mnb.worker.agent --standalone --local-addr=127.0.0.1 --nproc-per-node=2 \\
        -m mnb.worker --connect /tmp/mnb-pool-x/pool.json --device cpu

Several hosts (``--nnodes > 1``, ``%mnb start --ip``) use plain torchrun.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

LOOPBACK = "127.0.0.1"


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


def main(argv: list[str] | None = None) -> None:
    import torch.distributed as dist
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    loopback_store = _loopback_store_factory(dist.TCPStore)
    dist.TCPStore = loopback_store  # the worker store (dynamic_rendezvous uses dist.TCPStore)
    c10d_rendezvous_backend.TCPStore = loopback_store  # the rendezvous store
    run.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
