#!/usr/bin/env bash
# Download the wheels the agent image installs (container/requirements.txt) into container/wheelhouse/, for the image's
# Python (not this machine's), so `docker build -f container/Dockerfile .` needs no network.
#
#   container/build-wheelhouse.sh [--claude] [--python-version X.Y] [--arch ARCH] [--dest DIR]
#
#   --claude           also the lines of container/requirements.txt tagged "optional: claude"
#                      (the Agent SDK, which bundles the Claude Code CLI: ~170 MB download)
#   --python-version   the image's Python (default 3.11: Debian bookworm, python:3.11-slim)
#   --arch             x86_64 or aarch64 (default: this machine's)
#   --dest             output directory (default: container/wheelhouse)
#   PYTHON=...         the interpreter whose pip downloads (default python3)
#
# The directory is emptied of wheels first, so it holds exactly what the requirement files
# ask for. Only binary wheels are taken (--only-binary=:all:): nothing is built.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dest=$here/wheelhouse
claude=0
pyver=3.11
arch=$(uname -m)
while [ $# -gt 0 ]; do
  case $1 in
    --claude) claude=1 ;;
    --python-version) pyver=$2; shift ;;
    --arch) arch=$2; shift ;;
    --dest) dest=$2; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "build-wheelhouse: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
pip=("${PYTHON:-python3}" -m pip)
if ! "${pip[@]}" --version >/dev/null 2>&1; then
  echo "build-wheelhouse: needs pip on this machine (${PYTHON:-python3} -m pip)" >&2
  exit 1
fi
reqfile=$(mktemp)
trap 'rm -f "$reqfile"' EXIT
if [ "$claude" = 1 ]; then
  cp "$here/requirements.txt" "$reqfile"
else
  grep -v '#[[:space:]]*optional:[[:space:]]*claude' "$here/requirements.txt" >"$reqfile" || true
fi
reqs=(-r "$reqfile")
abi=cp${pyver/./}
mkdir -p "$dest"
rm -f "$dest"/*.whl
"${pip[@]}" download --quiet --disable-pip-version-check --only-binary=:all: \
  --implementation cp --python-version "$pyver" \
  --abi "$abi" --abi abi3 --abi none \
  --platform "manylinux_2_17_$arch" --platform "manylinux2014_$arch" \
  --platform "manylinux_2_28_$arch" --platform "linux_$arch" \
  --dest "$dest" "${reqs[@]}"
echo "build-wheelhouse: $(ls "$dest"/*.whl | wc -l) wheel(s) in $dest for Python $pyver/$arch" \
  "($(du -sh "$dest" | cut -f1))"
