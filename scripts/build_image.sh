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
fi
# The image's python3 must be the venv's (Debian's 3.11.2): the Triton stub links it.
podman run --rm localhost/dejavu-base:bookworm python3 -c \
    'import sys; assert sys.version_info[:2] == (3, 11), sys.version'
podman build -q -f deploy/Containerfile --target cpu -t localhost/dejavu-triton:cpu . >/dev/null
echo "built localhost/dejavu-triton:cpu"
