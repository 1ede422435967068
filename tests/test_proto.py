"""The generated modules must match yeto/proto/yeto.proto exactly."""

import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

from yeto.proto import yeto_pb2

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_matches_proto(tmp_path):
    out = tmp_path / "set.pb"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}",
                    f"--descriptor_set_out={out}", "yeto/proto/yeto.proto"], check=True)
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    checked_in = descriptor_pb2.FileDescriptorProto()
    yeto_pb2.DESCRIPTOR.CopyToProto(checked_in)
    for fd in (fresh, checked_in):  # json_name is filled by protoc only, not by CopyToProto
        _clear_json_names(fd.message_type)
    assert fresh == checked_in, ("yeto_pb2.py is stale; regenerate with: python -m "
                                 "grpc_tools.protoc -I. --python_out=. --pyi_out=. "
                                 "--grpc_python_out=. yeto/proto/yeto.proto")


def _clear_json_names(messages):
    for msg in messages:
        for field in msg.field:
            field.ClearField("json_name")
        _clear_json_names(msg.nested_type)


def test_service_stub_lists_every_rpc():
    from yeto.proto import yeto_pb2_grpc

    rpcs = {m.name for m in yeto_pb2.DESCRIPTOR.services_by_name["Syncer"].methods}
    src = Path(yeto_pb2_grpc.__file__).read_text()
    assert rpcs == {"Join", "Push", "Subscribe", "Heartbeat", "Status", "Finish"}
    assert all(f"/yeto.v1.Syncer/{r}" in src for r in rpcs)
