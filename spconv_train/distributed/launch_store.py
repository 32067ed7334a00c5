"""torchrun's store, shared by every attempt of one launch, on every node.

Under torchrun (c10d rendezvous, or static with ``--master-port``) the elastic agent hosts a
TCP store at ``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``) that lives
as long as the launch: across restarts, but not from one launch to the next. Two things
need it, because torchrun counts restarts per node: on several nodes, when one worker
fails, the healthy node's workers are restarted for the new rendezvous round with
``TORCHELASTIC_RESTART_COUNT`` still 0 while the failed node's count goes up.

- :func:`launch_recorded` / :func:`mark_recorded`: whether an earlier attempt of this launch
  recorded the job's start decision (``run_folder``), the same answer on every node.
- :func:`attempt_store`: the store for this attempt's process group, under a prefix that
  every worker of the attempt agrees on. The store keeps the keys of earlier attempts (a
  restarted gloo worker would read the dead peers' addresses), and a prefix made of the
  restart count differs between nodes. Rank 0 draws a fresh token; every other rank
  announces a fresh token of its own and waits for rank 0 to answer under that token, which
  only the current attempt's rank 0 can do (the earlier attempts' workers are gone).
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

__all__ = ["agent_store", "attempt_store", "join_attempt", "launch_recorded", "mark_recorded"]

_KEY = "spconv_train/launch"
_POLL_S = 0.02
_store: dist.Store | None = None  # this process's client of the agent's store


def agent_store(timeout: timedelta) -> dist.Store | None:
    """A client of the store torchrun's agent hosts for the whole launch (None when the
    workers were not given one: outside torchrun, or a store made anew for every attempt)."""
    global _store
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    if _store is None:
        host, port = os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500"))
        _store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    _store.set_timeout(timeout)
    return _store


def launch_recorded(job: str, timeout_s: float = 60.0) -> bool | None:
    """Whether an earlier attempt of this launch recorded the start decision of ``job``
    (None when there is no launch-long store to ask)."""
    try:
        store = agent_store(timedelta(seconds=timeout_s)) if job else None
        return None if store is None else store.check([f"{_KEY}/recorded/{job}"])
    except (RuntimeError, ValueError):  # unreachable: the process group will say so
        return None


def mark_recorded(job: str) -> None:
    """Rank 0, once ``job``'s start decision is written: later attempts follow it."""
    store = agent_store(timedelta(seconds=60)) if job else None
    if store is not None:
        store.set(f"{_KEY}/recorded/{job}", b"1")


def attempt_store(rank: int, world: int, timeout: timedelta) -> dist.Store | None:
    """The agent's store under a prefix only this attempt's workers share (None without an
    agent store: then every attempt gets a store of its own from ``env://``)."""
    store = agent_store(timeout)
    if store is None:
        return None
    return dist.PrefixStore(f"{_KEY}/attempt/{join_attempt(store, rank, world, timeout)}", store)


def join_attempt(store: dist.Store, rank: int, world: int, timeout: timedelta) -> str:
    """The token that names this attempt, the same on every rank (collective over ``store``,
    whatever keys earlier attempts left in it)."""
    token = uuid.uuid4().hex
    store.set(f"{_KEY}/join/{rank}", token)
    if rank == 0:
        _answer_joins(store, world, token, timeout)
        return token
    # blocks until this attempt's rank 0 answers (or the store's timeout)
    prefix = store.get(f"{_KEY}/answer/{token}").decode()
    store.set(f"{_KEY}/ack/{prefix}/{rank}", b"1")
    return prefix


def _answer_joins(store: dist.Store, world: int, prefix: str, timeout: timedelta) -> None:
    """Rank 0: tell every token announced for ranks 1.. the attempt's ``prefix`` until each
    rank acknowledged it (a token left by an earlier attempt is answered too, harmlessly:
    nobody waits for it, and the rank's new token replaces it)."""
    waiting, answered = set(range(1, world)), set()
    deadline = time.monotonic() + timeout.total_seconds()
    while waiting:
        for rank in sorted(waiting):
            join = f"{_KEY}/join/{rank}"
            token = store.get(join).decode() if store.check([join]) else None
            if token is not None and token not in answered:
                store.set(f"{_KEY}/answer/{token}", prefix.encode())
                answered.add(token)
            if store.check([f"{_KEY}/ack/{prefix}/{rank}"]):
                waiting.discard(rank)
        if waiting and time.monotonic() > deadline:
            shown = ", ".join(map(str, sorted(waiting)))
            raise RuntimeError(
                f"Timed out after {timeout.total_seconds():.0f} s waiting for rank(s) {shown} "
                "to join the process group"
            )
        if waiting:
            time.sleep(_POLL_S)
