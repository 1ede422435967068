"""Rollout nodes as a pool: whole groups round-robined over the nodes that answer.

Each step, the G completions of a prompt (a group) go to one node, so a group is
sampled by one weights version and shares one prompt prefill; a node gets all its
groups of the step in one ``/v1/completions`` request (``prompt`` a list of token
id lists, ``n`` = G), and the nodes are asked in parallel. A node that fails or
times out is reported and skipped: its groups go to the next node, and it is
tried again after a backoff (doubling up to a minute), so a node that comes back
is used again. Any OpenAI/vLLM-compatible server that returns
``return_tokens_as_token_ids`` logprobs works; ``yeto_version`` is -1 from servers
that do not say it.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

log = logging.getLogger("yeto.rl")


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    version: int
    node: str


MAX_ROWS = 64  # rows (prompts × G) per request: a yeto rollout node's default --max-batch


class NodeError(RuntimeError):
    """A node did not answer usefully (down, timed out, or a bad reply)."""


class NoNodes(RuntimeError):
    """No rollout node answered within the wait."""


@dataclass
class Node:
    url: str
    down_until: float = 0.0
    failures: int = 0            # consecutive
    total_failures: int = 0
    groups: int = 0
    last_error: str | None = None
    stats: dict = field(default_factory=dict)
    # kept current by the trainer (`yeto.rl.direct`): the adapter name it samples with,
    # the version it was told to load, the version its last reply said it serves
    model: str | None = None
    wanted: int = -1
    served: int = -1
    stale: bool = False          # it kept serving old weights: skipped for good

    def up(self, now: float) -> bool:
        return now >= self.down_until and not self.stale


def base_url(url: str) -> str:
    """'http://host:port' from 'http://host:port', '.../v1' or '.../v1/'."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class RolloutPool:
    def __init__(self, urls: list[str], *, timeout_s: float = 300.0, wait_s: float = 600.0,
                 retry_s: float = 2.0, api_key: str | None = None, model: str | None = None,
                 max_rows: int = MAX_ROWS):
        if not urls:
            raise ValueError("no --rollout-url: start a node with `python -m yeto.rollout "
                             "--model M --port 8080` and pass --rollout-url "
                             "http://127.0.0.1:8080/v1")
        self.nodes = [Node(base_url(u)) for u in urls]
        self.timeout_s, self.wait_s, self.retry_s = timeout_s, wait_s, retry_s
        self.api_key, self.model, self.max_rows = api_key, model, max_rows
        self._turn = 0
        self._exec = ThreadPoolExecutor(max_workers=max(1, len(urls)),
                                        thread_name_prefix="yeto-rollout-client")

    def sample(self, prompts: list[tuple[int, ...]], group_size: int,
               params: dict) -> list[list[Sample]]:
        """G completions of every prompt; groups whose node failed are retried on the
        others until `wait_s` passes without any node answering (then `NoNodes`)."""
        out: list[list[Sample] | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        since = time.monotonic()
        while todo:
            now = time.monotonic()
            up = [n for n in self.nodes if n.up(now)]
            if not up:
                if now - since > self.wait_s:
                    raise NoNodes(self._nobody())
                time.sleep(max(0.05, min(n.down_until for n in self.nodes) - now))
                continue
            todo = self._round(up, prompts, todo, group_size, params, out)
            if len(todo) < len(prompts):
                since = time.monotonic()
        return out  # type: ignore[return-value]

    def _round(self, up: list[Node], prompts, todo: list[int], g: int, params: dict,
               out: list) -> list[int]:
        """One request per node for its share of `todo`; returns the groups still to do."""
        shares: dict[int, list[int]] = {}
        for k, i in enumerate(todo):  # whole groups, round-robin, rotating across steps
            shares.setdefault((self._turn + k) % len(up), []).append(i)
        self._turn += len(todo)
        futures = {self._exec.submit(self._ask, up[j], [prompts[i] for i in idx], g, params): j
                   for j, idx in shares.items()}
        left = []
        for fut, j in futures.items():
            node, idx = up[j], shares[j]
            try:
                groups = fut.result()
            except NodeError as e:
                self._failed(node, str(e))
                left.extend(idx)
                continue
            if node.failures:
                log.info("rollout node %s answers again: using it", node.url)
            node.failures, node.groups = 0, node.groups + len(idx)
            for i, group in zip(idx, groups):
                out[i] = group
        return sorted(left)

    def _failed(self, node: Node, why: str) -> None:
        node.failures += 1
        node.total_failures += 1
        node.last_error = why
        backoff = min(self.retry_s * 2 ** (node.failures - 1), 60.0)
        node.down_until = time.monotonic() + backoff
        log.warning("rollout node %s failed (%s): skipped, its groups go to the other nodes; "
                    "trying it again in %.0fs", node.url, why, backoff)

    def _nobody(self) -> str:
        errors = "; ".join(f"{n.url}: {n.last_error}" for n in self.nodes)
        return (f"no rollout node answered for {self.wait_s:.0f}s ({errors}); start one with "
                "`python -m yeto.rollout --model M --port 8080`")

    def _ask(self, node: Node, prompts, g: int, params: dict) -> list[list[Sample]]:
        """The groups of `prompts` from one node, in requests of at most `max_rows`
        rows (prompts × G): a yeto node refuses more than its --max-batch."""
        per = max(1, self.max_rows // g)
        groups: list[list[Sample]] = []
        for lo in range(0, len(prompts), per):
            part = prompts[lo:lo + per]
            body = dict(params, prompt=[list(p) for p in part], n=g, logprobs=0,
                        return_tokens_as_token_ids=True)
            if node.model or self.model:
                body["model"] = node.model or self.model
            reply = post_json(f"{node.url}/v1/completions", body, self.timeout_s, self.api_key)
            try:
                groups += parse_groups(reply, len(part), g, node.url)
            except (KeyError, TypeError, ValueError) as e:
                raise NodeError(f"malformed reply: {e!r}") from e
            node.served = served_version(node, reply)
        return groups

    def report(self) -> list[dict]:
        return [dict(url=n.url, groups=n.groups, failures=n.total_failures,
                     up=n.up(time.monotonic()), last_error=n.last_error, stale=n.stale,
                     **(dict(lag=n.wanted - n.served) if n.wanted >= 0 else {}))
                for n in self.nodes]

    def close(self) -> None:
        self._exec.shutdown(wait=False, cancel_futures=True)


def post_json(url: str, body: dict, timeout_s: float, api_key: str | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode("utf-8", "replace")
        raise NodeError(f"HTTP {e.code}: {detail}") from e
    except (urllib.error.URLError, OSError, TimeoutError, json.JSONDecodeError) as e:
        raise NodeError(f"{type(e).__name__}: {getattr(e, 'reason', e)}") from e


def served_version(node: Node, reply: dict) -> int:
    """The weights version a reply was sampled with: a yeto node says it
    (`yeto_version`); a vLLM-style node echoes the adapter name it sampled with, which
    names the version the trainer last loaded on it."""
    version = int(reply.get("yeto_version", -1))
    if version >= 0:
        return version
    if node.model is not None and reply.get("model") == node.model:
        return node.wanted
    return node.served


def parse_groups(reply: dict, n_prompts: int, g: int, node: str) -> list[list[Sample]]:
    """The choices of a reply as groups (choice i*g + j is sample j of prompt i)."""
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    if len(choices) != n_prompts * g:
        raise ValueError(f"{len(choices)} choices for {n_prompts} prompts x n={g}")
    version = int(reply.get("yeto_version", -1))
    samples = []
    for c in choices:
        lp = c["logprobs"]
        if any(not t.startswith("token_id:") for t in lp["tokens"]):
            raise ValueError("tokens are not token ids (return_tokens_as_token_ids ignored?)")
        ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        samples.append(Sample(ids, [float(x) for x in lp["token_logprobs"]], c["text"],
                              c["finish_reason"], version, node))
    return [samples[i * g:(i + 1) * g] for i in range(n_prompts)]
