"""A CPU model of how NCCL orders the torch.distributed calls each rank makes, to find the call
sequences that would hang on GPUs although they pass on gloo.

What it models (NCCL's documented semantics, and torch's for a group made with `device_id`, which
initialises NCCL eagerly):
- Every operation a rank issues runs in the order issued, one after another, on that rank's
  communicator stream. torch's warning: "In eager initialization mode, unbatched P2P ops are
  treated as independent collective ops, and are thus serialized with all other ops on this
  ProcessGroup". Calling `wait()` later changes nothing: the op is already queued.
- A collective runs only when every rank has reached it; the ranks must agree on which one.
- A send and its receive run only together (a receive blocks the stream until the peer's send
  runs, and a send may wait for its receive); pairs between two ranks match in the order issued.
- `batch_isend_irecv` puts its ops in one NCCL group: they start together and the group ends when
  all of them have, so a group needs every peer's matching op at the head of that peer's queue.

`recording(rank)` records what the real code calls, either instead of communicating (for code
whose calls do not depend on what it receives, such as commcheck's cases) or while passing every
call through to the real backend (gloo), for code that decides on what it received (resume).
`replay` then runs the recorded queues under the rules above and names the deadlock, if any.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Union

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


@dataclass(frozen=True)
class P2P:
    kind: str  # "send" or "recv"
    peer: int
    numel: int

    def __str__(self) -> str:
        return f"{self.kind} {'to' if self.kind == 'send' else 'from'} rank {self.peer} ({self.numel} elements)"


@dataclass(frozen=True)
class Group:
    """`batch_isend_irecv`'s ops, which NCCL starts and completes as one unit."""

    ops: tuple[P2P, ...]

    def __str__(self) -> str:
        return "batch_isend_irecv[" + ", ".join(map(str, self.ops)) + "]"


@dataclass(frozen=True)
class Collective:
    name: str
    root: int | None = None

    def __str__(self) -> str:
        return self.name + (f"(root {self.root})" if self.root is not None else "")


Op = Union[P2P, Group, Collective]

# Each recorded function, and which keyword (or position) names its root, for the collectives.
P2P_CALLS = {"send": ("send", "dst", 1), "recv": ("recv", "src", 1), "isend": ("send", "dst", 1),
             "irecv": ("recv", "src", 1)}
COLLECTIVES = {"broadcast": ("src", 1), "reduce": ("dst", 1), "all_reduce": None, "all_gather": None,
               "all_gather_into_tensor": None, "gather": ("dst", 2), "scatter": ("src", 2),
               "reduce_scatter": None, "reduce_scatter_tensor": None, "reduce_scatter_single": None, "all_to_all": None,
               "all_to_all_single": None, "barrier": None, "broadcast_object_list": ("src", 1),
               "all_gather_object": None, "gather_object": ("dst", 2), "scatter_object_list": ("src", 2)}


class _Done:
    """What a recorded call returns when nothing was sent: a finished request."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass(frozen=True)
class _RecordedP2POp:
    """dist.P2POp without a process group: what batch_isend_irecv is asked to do."""

    op: object
    tensor: object
    peer: int


def _argument(args: tuple, kwargs: dict, name: str, position: int):
    return kwargs[name] if name in kwargs else (args[position] if len(args) > position else None)


@contextmanager
def recording(ops: list[Op], communicate: bool) -> Iterator[None]:
    """Append every torch.distributed call this process makes to `ops`. `communicate`: pass each
    call through to the real process group; else record it and return as if it had finished.
    Calls that torch makes inside a recorded one (broadcast_object_list's broadcasts,
    batch_isend_irecv's isends) belong to it and are not recorded again."""
    depth = threading.local()
    originals = {name: getattr(c10d, name) for name in [*P2P_CALLS, *COLLECTIVES, "batch_isend_irecv"]}

    def record(op: Op) -> None:
        if getattr(depth, "n", 0) == 0:
            ops.append(op)

    def passing(name: str, make_op, returns_work: bool):
        original = originals[name]

        def call(*args, **kwargs):
            record(make_op(args, kwargs))
            if not communicate:
                return [_Done() for _ in args[0]] if name == "batch_isend_irecv" else (
                    _Done() if returns_work else None)
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                depth.n -= 1
        call.__name__ = name
        return call

    def p2p(name: str):
        kind, key, position = P2P_CALLS[name]
        return lambda args, kwargs: P2P(kind, _argument(args, kwargs, key, position), args[0].numel())

    def collective(name: str):
        root = COLLECTIVES[name]
        return lambda args, kwargs: Collective(name, _argument(args, kwargs, *root) if root else None)

    def group(args, kwargs) -> Group:
        return Group(tuple(P2P("send" if op.op.__name__ == "isend" else "recv", op.peer, op.tensor.numel())
                           for op in args[0]))

    patched = {name: passing(name, p2p(name), name.startswith("i")) for name in P2P_CALLS}
    patched |= {name: passing(name, collective(name), True) for name in COLLECTIVES}
    patched["batch_isend_irecv"] = passing("batch_isend_irecv", group, True)
    if not communicate:  # the real P2POp needs a process group to resolve its peer in
        patched["P2POp"] = _RecordedP2POp
        originals["P2POp"] = c10d.P2POp
    # Both namespaces: the code calls torch.distributed.*, and P2POp checks its op against c10d's.
    try:
        for name, function in patched.items():
            setattr(c10d, name, function)
            setattr(dist, name, function)
        yield
    finally:
        for name, function in originals.items():
            setattr(c10d, name, function)
            setattr(dist, name, function)


def _units(op: Op) -> tuple[P2P, ...]:
    return op.ops if isinstance(op, Group) else (op,)


def _matches(op: P2P, rank: int, peer_unit: tuple[P2P, ...]) -> bool:
    wanted = P2P("recv" if op.kind == "send" else "send", rank, op.numel)
    return wanted in peer_unit


def replay(queues: list[list[Op]]) -> str | None:
    """Run every rank's queue under NCCL's rules; None if all drain, else what each stuck rank waits on."""
    position = [0] * len(queues)

    def head(rank: int) -> Op | None:
        return queues[rank][position[rank]] if position[rank] < len(queues[rank]) else None

    while any(head(r) is not None for r in range(len(queues))):
        heads = [head(r) for r in range(len(queues))]
        if all(isinstance(h, Collective) for h in heads):
            if len(set(heads)) > 1:
                return "ranks disagree on the next collective: " + "; ".join(
                    f"rank {r}: {h}" for r, h in enumerate(heads))
            position = [p + 1 for p in position]
            continue
        # The P2P heads that can run together: drop any whose peer's head lacks its match, until none drops.
        ready = {r for r, h in enumerate(heads) if isinstance(h, (P2P, Group))}
        changed = True
        while changed:
            changed = False
            for r in sorted(ready):
                unit = _units(heads[r])
                peers_ok = all(op.peer in ready and _matches(op, r, _units(heads[op.peer])) for op in unit)
                counts_ok = all(Counter((o.kind, o.peer) for o in unit)[(op.kind, op.peer)] ==
                                Counter((o.kind, o.peer) for o in _units(heads[op.peer]) if o.peer == r)[
                                    ("recv" if op.kind == "send" else "send", r)]
                                for op in unit if op.peer in ready)
                if not (peers_ok and counts_ok):
                    ready.discard(r)
                    changed = True
        if not ready:
            return "deadlock: " + "; ".join(f"rank {r} waits in {h}" for r, h in enumerate(heads) if h is not None)
        for r in ready:
            position[r] += 1
    return None
