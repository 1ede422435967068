"""The generated modules must match yeto/proto/yeto.proto exactly.

Here: the checks that need no process, server or training (the others:
tests/e2e/test_proto.py)."""


from pathlib import Path

from yeto.proto import yeto_pb2


def test_service_stub_lists_every_rpc():
    from yeto.proto import yeto_pb2_grpc

    rpcs = {m.name for m in yeto_pb2.DESCRIPTOR.services_by_name["Syncer"].methods}
    src = Path(yeto_pb2_grpc.__file__).read_text()
    assert rpcs == {"Join", "Push", "Subscribe", "Heartbeat", "Status", "Finish",
                    "RegisterStandby", "Replicate"}
    assert all(f"/yeto.v1.Syncer/{r}" in src for r in rpcs)
