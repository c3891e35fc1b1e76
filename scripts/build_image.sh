#!/usr/bin/env bash
# Build the CPU image localhost/dejavu-triton:cpu with rootful podman (deploy/Containerfile).
# Needs `make install` first (the image takes its venv) and podman, runc, debootstrap.
# The base image (a debootstrapped Debian bookworm with python3) is made once and kept in
# podman's storage ($DEJAVU_PODMAN_DIR, default /var/tmp/dejavu-podman): cache that folder.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/podman_env.sh

if ! podman image exists localhost/dejavu-base:bookworm; then
    rootfs=$(mktemp -d /var/tmp/dejavu-rootfs.XXXXXX)
    mirror=$(sed -n 's/^URIs: *//p; s/^deb \(http[^ ]*\) bookworm .*/\1/p' \
        /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | head -1 || true)
    debootstrap --variant=minbase --include=python3,libpython3.11,curl,ca-certificates \
        bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >/dev/null
    tar -C "$rootfs" -c . | podman import - localhost/dejavu-base:bookworm >/dev/null
    rm -rf "$rootfs"
    # The image's python3 must be the venv's (Debian's 3.11.2): the Triton stub links it.
    podman run --rm localhost/dejavu-base:bookworm python3 -c \
        'import sys; assert sys.version_info[:2] == (3, 11), sys.version'
fi
# What the image is made of: the build files, the sources and the venv's packages (names and
# versions, not its paths: another checkout's equal venv makes the same image). An image
# labelled with the same digest is kept: building again costs ~40 s even with every layer
# cached (podman hashes the 2 GB venv to find its layer).
inputs=$({ sha256sum deploy/Containerfile .containerignore pyproject.toml README.md
           find orchestrator clients backends model_repository -type f \
               ! -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum
           ls .venv/lib/python3.11/site-packages | grep dist-info; } | sha256sum | cut -c1-32)
image=localhost/dejavu-triton:cpu
if [ "$(podman image inspect --format '{{index .Labels "dejavu.inputs"}}' "$image" \
        2>/dev/null)" = "$inputs" ]; then
    echo "$image is up to date ($inputs)"
    exit 0
fi
podman build -q -f deploy/Containerfile --target cpu --label "dejavu.inputs=$inputs" \
    -t "$image" . >/dev/null
echo "built $image ($inputs)"
