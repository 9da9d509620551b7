#!/usr/bin/env bash
# Regenerates the kubelet pod-resources v1 client (agent/podresources_v1_pb2.py, _pb2.pyi,
# _pb2_grpc.py) from agent/podresources_v1.proto with grpcio-tools (pinned in the dev extra).
# The proto is mapped to vigil/agent/ so the generated modules import each other as vigil.agent.*.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
.venv/bin/python -m grpc_tools.protoc -Ivigil/agent=agent \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" vigil/agent/podresources_v1.proto
cp "$out"/vigil/agent/podresources_v1_pb2.py "$out"/vigil/agent/podresources_v1_pb2.pyi \
  "$out"/vigil/agent/podresources_v1_pb2_grpc.py agent/
