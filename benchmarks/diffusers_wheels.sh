#!/usr/bin/env bash
# The GPU machine's image has no diffusers: download diffusers 0.42.1 and what it needs as wheels
# into .whl/diffusers (run here, from the repo root, with network), then carry that folder to the
# device and install it there with no index. numpy and pillow are left out (the image has them);
# huggingface_hub is pinned below 2 (diffusers 0.42 refuses 2.x at import). About 14 MB.
#   bash benchmarks/diffusers_wheels.sh
#   device (carry .whl/diffusers):
#     pip install --no-index --no-deps --target /tmp/dsite .whl/diffusers/*.whl &&
#     DIFFUSERS_SITE=/tmp/dsite bash benchmarks/gpu_verify.sh "$OUT" diffusers-all
set -euo pipefail
dir=.whl/diffusers
mkdir -p "$dir"
pip download --only-binary=:all: --python-version 3.12 --dest "$dir" diffusers==0.42.1 "huggingface_hub>=1.5,<2"
rm -f "$dir"/numpy-*.whl "$dir"/pillow-*.whl
du -sh "$dir"
