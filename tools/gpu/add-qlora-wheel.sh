#!/usr/bin/env bash
# Adds bitsandbytes to .whl/ (after ../shared/gpu/fetch-wheels.sh), so the GPU machine's prelude installs it and
# tests/gpu/test_qlora_cuda.py runs there instead of skipping: the image has no bitsandbytes and no network.
# The wheel is 43 MB with the kernels of every CUDA, ROCm and XPU version; `run` carries 64 MiB in all and .whl/
# already holds ~21 MiB, so only the CUDA 13 (the image's torch is cu130) and CPU libraries are kept: ~7 MB.
#   PY=.venv/bin/python tools/gpu/add-qlora-wheel.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
VERSION=0.50.2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q "bitsandbytes==$VERSION" --python-version 3.12 --platform manylinux_2_24_x86_64 \
  --only-binary=:all: --no-deps -d "$tmp"
mkdir -p .whl
"$PY" - "$tmp"/bitsandbytes-*.whl ".whl" <<'PYTHON'
import base64, hashlib, pathlib, re, sys, zipfile

source, target = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]) / pathlib.Path(sys.argv[1]).name
keep_lib = re.compile(r"bitsandbytes/libbitsandbytes_(cuda13\d|cpu)\.so$")
with zipfile.ZipFile(source) as wheel:
    names = [n for n in wheel.namelist() if not n.endswith(".so") or keep_lib.search(n)]
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    rows = []
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
        for name in names:
            if name == record:
                continue
            data = wheel.read(name)
            out.writestr(wheel.getinfo(name), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{name},sha256={digest},{len(data)}")
        out.writestr(record, "\n".join(rows + [f"{record},,"]) + "\n")
print(f"{target}: {target.stat().st_size / 2**20:.1f} MiB, {len(names)} files")
PYTHON
du -sh .whl
