"""`python -m yeto.rollout`: start a rollout node (see `yeto.rollout.server`).

Examples:
    python -m yeto.rollout --model runs/demo/model --adapter runs/sft/adapter --port 8080
    python -m yeto.rollout --model runs/demo/model --backend mlx --syncer 127.0.0.1:29400
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from pathlib import Path

from yeto import net, runfile
from yeto.config import HelpFormatter, island_parser
from yeto.io import atomic_write
from yeto.net import is_loopback
from yeto.rollout.adapters import AdapterError, LoraSpec, read_adapter
from yeto.signals import GracefulStop
from yeto.targets import TARGET_MODES

log = logging.getLogger("yeto.rollout")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m yeto.rollout", formatter_class=HelpFormatter,
        description="A rollout node: an OpenAI/vLLM-compatible completion server that returns "
                    "sampled token ids and their logprobs (for RL), on torch or MLX. With "
                    "--syncer it observes a run and serves every merged Θ.",
        epilog="Example:\n  python -m yeto.rollout --model runs/demo/model --backend mlx "
               "--syncer 127.0.0.1:29400 --port 8081")
    p.add_argument("--model", required=True, help="local Hugging Face model dir")
    p.add_argument("--backend", choices=("torch", "mlx"), default="torch")
    p.add_argument("--adapter", type=Path, default=None,
                   help="a peft or mlx-lm LoRA adapter dir to serve (sets the LoRA shape)")
    p.add_argument("--adapter-root", type=Path, action="append", default=None, metavar="DIR",
                   help="POST /reload_adapter loads only adapters under this dir, after "
                        "symlinks and '..' are resolved (repeatable). Default: the current "
                        "working directory and the directory holding --adapter")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header is NAME (repeatable; '*': "
                        "any). By default only loopback names, the --host address and, "
                        "beyond loopback, this machine's host names (DNS-rebinding guard)")
    p.add_argument("--port", type=net.port, default=8080, help="0: any free port")
    p.add_argument("--port-file", type=Path, default=None,
                   help="write the port here once listening (for --port 0)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id of /v1/models (default: --model)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default $YETO_ROLLOUT_API_KEY)")
    p.add_argument("--insecure", action="store_true",
                   help="allow listening beyond loopback without --api-key")
    p.add_argument("--max-batch", type=int, default=64,
                   help="rows sampled together at most; a request for more rows (prompts x "
                        "n) is refused with 400")
    p.add_argument("--request-log", type=Path, default=None,
                   help="append one JSON line per request (prompt ids, n, version)")
    _add_run_args(p)
    runfile.add_config_arg(p)
    return p


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--syncer", default=None,
                   help="host:port of a run's syncer: observe it (receive every merged Θ)")
    p.add_argument("--token", default=None, help=f"syncer token (default ${net.TOKEN_ENV})")
    p.add_argument("--tls-ca", type=Path, default=None)
    p.add_argument("--tls-cert", type=Path, default=None)
    p.add_argument("--tls-key", type=Path, default=None)
    p.add_argument("--node-id", default=None,
                   help="this node's name in the run (default rollout-<backend>-<port>)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (without --adapter)")
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--lora-targets", default="auto",
                   help=f"{' | '.join(TARGET_MODES)} | comma list (as the islands')")
    p.add_argument("--seed", type=int, default=0, help="LoRA init seed (as the islands')")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--log-level", default="INFO")


def build_engine(args):
    """The engine of `--backend`, with the LoRA of --adapter or of the flags."""
    spec = LoraSpec(args.lora_r, args.lora_alpha, args.lora_targets)
    if args.adapter is not None:
        _, spec, _ = read_adapter(args.adapter, args.model)
    if args.backend == "mlx":
        from yeto.mlx import INSTALL_HINT, mlx_available

        if not mlx_available():
            raise SystemExit(f"error: {INSTALL_HINT}")
        from yeto.rollout.mlx_engine import MLXEngine

        engine = MLXEngine(args.model, spec, seed=args.seed)
    else:
        import torch

        from yeto.rollout.torch_engine import TorchEngine

        if args.threads:
            torch.set_num_threads(args.threads)
        engine = TorchEngine(args.model, spec, device=args.device, seed=args.seed)
    if args.adapter is not None:
        engine.load_adapter(args.adapter)
    return engine


def adapter_roots(args) -> list[Path]:
    """--adapter-root, else the working directory and the directory holding --adapter."""
    if args.adapter_root:
        return list(args.adapter_root)
    roots = [Path.cwd()]
    if args.adapter is not None:
        roots.append(args.adapter.resolve().parent)
    return roots


def observe(node, args, port: int) -> None:
    """Join `--syncer` as an observer; merged Θ then reaches `node`'s scheduler."""
    from yeto.client import TLSConfig
    from yeto.rollout.observer import Follower, ObserverClient

    engine = node.engine
    node_id = args.node_id or f"rollout-{engine.name}-{port}"
    client = ObserverClient(args.syncer, node_id, engine.layout, token=args.token,
                            backend=engine.name,
                            tls=TLSConfig.from_files(args.tls_ca, args.tls_cert, args.tls_key))
    node.scheduler.version = -1  # not the run's weights until the first Θ arrives
    node.follower = Follower(client, engine.layout, node.scheduler)
    node.follower.start(engine.weights.get())
    log.info("observing the run at %s as %s", args.syncer, node_id)


def main(argv=None) -> int:
    args = runfile.parse(build_parser(), argv, "rollout", programs={"island": island_parser})
    logging.basicConfig(level=args.log_level.upper(), datefmt="%H:%M:%S",
                        format="%(asctime)s rollout %(message)s")
    from yeto.rollout.engine import stop_token_ids
    from yeto.rollout.server import RolloutNode, api_key_from_env, make_server

    key = api_key_from_env(args.api_key)
    if not is_loopback(args.host) and not key and not args.insecure:
        print(f"error: listening on {args.host} without --api-key lets anyone sample and load "
              "adapters; pass --api-key KEY (or --insecure)", file=sys.stderr)
        return 2
    try:
        engine = build_engine(args)
    except (AdapterError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    node = RolloutNode(engine, model_name=args.served_model_name or args.model,
                       eos_ids=stop_token_ids(args.model, engine.tokenizer),
                       max_batch=args.max_batch, api_key=key, request_log=args.request_log,
                       aliases=(str(Path(args.model).resolve()),),
                       adapter_roots=adapter_roots(args))
    server = make_server(node, args.host, args.port, tuple(args.allow_host))
    port = server.server_address[1]
    if args.syncer:
        observe(node, args, port)
    return _serve(server, node, args, port)


def _serve(server, node, args, port: int) -> int:
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="yeto-http")
    thread.start()
    if args.port_file is not None:
        atomic_write(args.port_file, str(port))
    log.info("serving %s (%s, %d LoRA parameters) on http://%s:%d/v1", node.ctx.model_name,
             node.engine.name, node.engine.layout.numel, args.host, port)
    with GracefulStop(on_first=lambda name: log.info("%s: stopping", name)) as stop:
        stop.event.wait()
    server.shutdown()
    server.server_close()
    node.close()
    return 0
