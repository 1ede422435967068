"""A rollout node in a run: it joins the syncer as an **observer**.

An observer authenticates like an island (token, TLS) and joins with its layout,
which must be the run's; it never pushes and never counts toward the quorum. It
receives every committed Θ (`yeto.client.SyncerClient` does the receiving: join,
backoff, rejoin, broadcast reassembly) and hands each whole Θ to the node's
scheduler, which applies it between batches."""

from __future__ import annotations

import logging
import threading

import numpy as np

from yeto.client import SyncerClient
from yeto.proto import yeto_pb2 as pb
from yeto.transport import Refused

log = logging.getLogger("yeto.rollout")


class ObserverClient(SyncerClient):
    """The gRPC client of an observer: joins flagged ``observer``, refuses to push."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "observer" not in pb.JoinRequest.DESCRIPTOR.fields_by_name:
            raise RuntimeError("this yeto's syncer protocol has no observers (JoinRequest."
                               "observer); upgrade yeto on the node and the syncer")
        self.connection.join_request.observer = True

    def push(self, *args, **kwargs):
        raise Refused("an observer never pushes")

    def finish(self) -> None:  # an observer has no training to finish
        pass


class Follower:
    """Receives Θ on a thread and offers each complete one to `scheduler`."""

    def __init__(self, client: SyncerClient, layout, scheduler):
        self.client, self.layout, self.scheduler = client, layout, scheduler
        self.versions: dict[int, int] = {}
        self.received = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def version(self) -> int:
        return max(self.versions.values(), default=-1)

    def start(self, initial: np.ndarray) -> None:
        self.flat = np.array(initial, dtype=np.float32, copy=True)
        self.client.start(self.flat)
        self._thread = threading.Thread(target=self._run, daemon=True, name="yeto-observer")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            got = self.client.wait(timeout=1.0)
            if got:
                self._take(got)
            if self.client.fatal:
                log.error("the syncer refused this node: %s", self.client.fatal)
                return
            if self.client.finished and not got:
                log.info("the run finished: serving its final weights (version %d)",
                         self.version)
                return

    def _take(self, got) -> None:
        frags = self.layout.with_fragments(self.client.num_fragments).fragments
        for r in got:
            frag = frags[r.fragment]
            self.flat[frag.start:frag.stop] = r.theta
            self.versions[r.fragment] = r.version
            self.received += 1
        if len(self.versions) == len(frags):  # every fragment known: a whole Θ
            self.scheduler.offer(self.flat.copy(), self.version)

    def status(self) -> dict:
        c = self.client
        return dict(syncer=c.address, connected=c.connected.is_set(), version=self.version,
                    received=self.received, finished=c.finished, error=c.fatal or c.last_error)

    def close(self) -> None:
        self._stop.set()
        self.client.close()
