#!/usr/bin/env bash
# Load a newer cuDNN than torch's into one process, for probes on the device machine (which
# has torch's cuDNN 9.19 and no network). The device's carry is limited to 64 MiB per call, so
# the libraries come xz-compressed, split over consecutive calls (the machine keeps /tmp while
# it stays warm):
#   here:    bash benchmarks/newer_cudnn.sh pack WHEEL DIR_A DIR_B   # graph lib -> A; the rest -> B
#   device:  bash benchmarks/newer_cudnn.sh unpack DIR               # into /tmp/cdn/nvidia/cudnn/lib
#   device:  bash benchmarks/newer_cudnn.sh run CMD...               # CMD with that cuDNN preloaded
# Only what LayerNorm/RMSNorm graphs need is carried: libcudnn, graph, ext, runtime-compiled
# engines and heuristics (not the precompiled/tensor-IR engines or the legacy ops/cnn/adv APIs).
set -euo pipefail
lib=/tmp/cdn/nvidia/cudnn/lib
case ${1:?pack|unpack|run} in
  pack)
    wheel=${2:?wheel}; a=${3:?dir A}; b=${4:?dir B}; tmp=$(mktemp -d)
    mkdir -p "$a" "$b"
    unzip -q -o "$wheel" 'nvidia/cudnn/lib/*' -d "$tmp"
    xz -9e -T0 -c "$tmp/nvidia/cudnn/lib/libcudnn_graph.so.9" > "$a/libcudnn_graph.so.9.xz"
    for f in libcudnn.so.9 libcudnn_ext.so.9 libcudnn_engines_runtime_compiled.so.9 libcudnn_heuristic.so.9; do
      [ -f "$tmp/nvidia/cudnn/lib/$f" ] && xz -9e -T0 -c "$tmp/nvidia/cudnn/lib/$f" > "$b/$f.xz"
    done
    rm -rf "$tmp"; du -sh "$a" "$b" ;;
  unpack)
    mkdir -p "$lib"
    python3 - "${2:?dir}" "$lib" <<'PY'
import lzma, pathlib, shutil, sys
src, dst = map(pathlib.Path, sys.argv[1:3])
for f in sorted(src.glob("*.xz")):
    with lzma.open(f) as fin, open(dst / f.name[:-3], "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 24)
    print("unpacked", f.name[:-3], (dst / f.name[:-3]).stat().st_size >> 20, "MiB")
PY
    # the libraries' RUNPATH looks for nvrtc/cublas beside the cudnn folder, as pip lays them out
    site=$(python3 -c "import os, nvidia; print(os.path.dirname(list(nvidia.__path__)[0]))")
    for d in "$site"/nvidia/*/; do n=$(basename "$d"); [ "$n" = cudnn ] || ln -sfn "$d" "/tmp/cdn/nvidia/$n"; done ;;
  run)
    shift
    LD_PRELOAD="$lib/libcudnn.so.9:$lib/libcudnn_graph.so.9" "$@" ;;
esac
