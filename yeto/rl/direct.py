"""Rollout nodes the trainer keeps current (`--update-nodes`): nodes that do not
observe the syncer (a vLLM server, a yeto node started without --syncer) would sample
the weights they started with forever, and the reward would stay flat.

Every --sync-every steps the trainer saves its adapter under --node-adapter-dir (peft
format: vLLM, and yeto's torch and MLX nodes, load it) and asks each node to load it
with vLLM's ``POST /v1/load_lora_adapter`` {lora_name, lora_path} (a yeto node speaks
it too); the node's next requests sample with that ``lora_name``. The folder must be
one each node can read at the same path (the same machine, or a shared filesystem).

A node that accepted an adapter but whose replies show older weights
(``yeto_version``, or the adapter name a vLLM-style node echoes), or that refuses the
adapter's name, `stale_after` updates in a row, is reported and skipped for the rest of
the run: its samples would not come from the policy being trained. (A node that is
down is not judged: it told nothing new, and is retried as usual.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from yeto.rl.pool import NodeError, NoNodes, RolloutPool, post_json

log = logging.getLogger("yeto.rl")


class NodeUpdater:
    def __init__(self, pool: RolloutPool, folder: Path, save: Callable[[Path], Path],
                 stale_after: int = 2, timeout_s: float = 120.0):
        self.pool, self.folder, self.save = pool, Path(folder), save
        self.stale_after, self.timeout_s = stale_after, timeout_s
        self.updates = 0
        self.behind: dict[str, int] = {n.url: 0 for n in pool.nodes}
        self.asked: dict[str, tuple] = {n.url: (0, 0) for n in pool.nodes}  # at the last update

    def update(self, step: int) -> None:
        """Save the adapter as of `step`, load it on every node still in use, and skip
        the nodes that kept serving older weights."""
        self._check_stale()
        path = Path(self.save((self.folder / f"step-{step}").resolve()))  # the adapter's dir
        self.updates += 1
        name = f"yeto-step-{step}"
        for node in (n for n in self.pool.nodes if not n.stale):
            body = dict(lora_name=name, lora_path=str(path), version=self.updates)
            try:
                post_json(f"{node.url}/v1/load_lora_adapter", body, self.timeout_s,
                          self.pool.api_key)
            except NodeError as e:
                log.warning("rollout node %s did not load %s (%s): it samples with older "
                            "weights until a later update works", node.url, path, e)
                continue
            node.model, node.wanted = name, self.updates
        if all(n.stale for n in self.pool.nodes):
            raise NoNodes("every rollout node kept serving old weights after being told to "
                          "load new ones; see the warnings above")

    def _check_stale(self) -> None:
        for node in self.pool.nodes:
            # groups answered and failures since the last update: a node that refuses
            # the adapter's name (it did not load it) was asked, too
            asked, self.asked[node.url] = self.asked[node.url], (node.groups,
                                                                 node.total_failures)
            if node.stale or node.wanted < 0 or self.asked[node.url] == asked:
                continue  # told nothing yet, or not asked since: nothing to judge
            self.behind[node.url] = self.behind[node.url] + 1 if node.served < node.wanted \
                else 0
            if self.behind[node.url] >= self.stale_after:
                node.stale = True
                log.error("rollout node %s still serves version %d after %d updates to "
                          "version %d: skipped for the rest of the run (does it load "
                          "adapters? vLLM needs --enable-lora and "
                          "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)", node.url, node.served,
                          self.behind[node.url], node.wanted)
