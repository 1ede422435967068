"""The generated modules must match yeto/proto/yeto.proto exactly.

Here: the checks that need real processes (the others: tests/unit/test_proto.py)."""


import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

from yeto.proto import yeto_pb2

ROOT = Path(__file__).resolve().parents[2]


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
