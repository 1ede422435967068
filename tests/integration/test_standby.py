"""Standby syncers, the checks that need no process: a real primary and a real standby
service on loopback. Only the run's secret registers a standby or sends it a replica; a
replica that is cut short, too big or not this run's leaves the standby's state as it
was (the process test, a primary killed mid-run: tests/e2e/test_standby.py)."""

from __future__ import annotations

import shutil
from concurrent import futures

import grpc
import numpy as np
import pytest
from helpers.syncer import running_syncer

from syncer import state
from syncer.run import Config, PushHeader, Run
from syncer.staging import WholePush
from syncer.standby import Standby, StandbyService
from yeto import codec, net
from yeto.layout import Layout
from yeto.proto import yeto_pb2 as pb
from yeto.proto import yeto_pb2_grpc as pb_grpc

SECRET = "run-secret"
LAYOUT = Layout.from_shapes({"m.q_proj.lora_A.weight": (2, 8), "m.q_proj.lora_B.weight": (8, 2)})


def _saved(state_dir, secret=SECRET, rounds=2):
    """A state dir a real run saved after `rounds` commits."""
    run = Run(Config(quorum=1, state_dir=state_dir, token=secret))
    gen = run.join("a", LAYOUT.specs, LAYOUT.fingerprint, "numpy", "w.safetensors", {})[
        "generation"]
    n = LAYOUT.numel
    run.push(PushHeader("a", gen, 0, 0, 0, 0, 0, "f32", n, 4 * n, True, 0),
             WholePush(codec.encode(np.zeros(n, np.float32), "f32")))
    for v in range(rounds):
        run.push(PushHeader("a", gen, v + 1, 0, v, 10, 1, "f32", n, 4 * n, False, v + 1),
                 WholePush(codec.encode(np.full(n, 0.01, np.float32), "f32")))
    run.tape.close()
    return state_dir / state.STATE_FILE


@pytest.fixture
def standby(tmp_path):
    """A standby service on loopback: (its Standby, its address)."""
    sb = Standby(tmp_path / "standby", state.StateKey(SECRET), "127.0.0.1:1", "unused", 5.0,
                 1 << 20)
    (tmp_path / "standby").mkdir()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_SyncerServicer_to_server(StandbyService(sb, SECRET), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sb, f"127.0.0.1:{port}"
    server.stop(0)


def _replicate(address, data: bytes, size: int, token=SECRET, version=2):
    chunks = [pb.ReplicateChunk(version=version, size=size, data=data[:100]),
              pb.ReplicateChunk(data=data[100:])]
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.SyncerStub(ch).Replicate(iter(chunks), metadata=net.auth_metadata(token),
                                                timeout=30)


def test_a_standby_takes_only_whole_replicas_of_its_run_from_the_secret(tmp_path, standby):
    sb, address = standby
    good = _saved(tmp_path / "run").read_bytes()
    other = _saved(tmp_path / "other", secret="another-secret").read_bytes()
    for data, size, token, code in [
            (good, len(good), "wrong", grpc.StatusCode.UNAUTHENTICATED),
            (good[:-10], len(good), SECRET, grpc.StatusCode.INVALID_ARGUMENT),  # cut short
            (good, 2 << 20, SECRET, grpc.StatusCode.INVALID_ARGUMENT),  # over its bound
            (other, len(other), SECRET, grpc.StatusCode.INVALID_ARGUMENT)]:  # not this run's
        with pytest.raises(grpc.RpcError) as e:
            _replicate(address, data, size, token)
        assert e.value.code() == code, e.value.details()
        assert sb.version == 0 and not (tmp_path / "standby" / state.STATE_FILE).exists()
    assert _replicate(address, good, len(good)).version == 2
    assert (tmp_path / "standby" / state.STATE_FILE).read_bytes() == good
    # an older state never replaces a newer one
    older = _saved(tmp_path / "older", rounds=1).read_bytes()
    assert _replicate(address, older, len(older), version=1).version == 2
    assert (tmp_path / "standby" / state.STATE_FILE).read_bytes() == good


def test_only_the_run_s_secret_registers_a_standby(tmp_path):
    with running_syncer(quorum=1, state_dir=tmp_path / "s", token=SECRET,
                        secret=SECRET) as (run, addr):
        with grpc.insecure_channel(addr) as ch:
            stub = pb_grpc.SyncerStub(ch)
            request = pb.RegisterStandbyRequest(address="127.0.0.1:9", version=0)
            island = net.auth_metadata(net.credential_for(SECRET, "island-0"))
            with pytest.raises(grpc.RpcError) as e:
                stub.RegisterStandby(request, metadata=island, timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert run.standbys.known() == {}
            reply = stub.RegisterStandby(request, metadata=net.auth_metadata(SECRET),
                                         timeout=10)
            assert reply.run_id == run.run_id and run.standbys.known() == {"127.0.0.1:9": 0}


def test_a_standby_resumes_the_state_it_was_sent(tmp_path, standby):
    sb, address = standby
    good = _saved(tmp_path / "run").read_bytes()
    _replicate(address, good, len(good))
    shutil.rmtree(tmp_path / "standby" / ".incoming", ignore_errors=True)
    back = Run(Config(quorum=1, state_dir=tmp_path / "standby", token=SECRET, resume=True))
    assert back.version == 2
    back.tape.close()
