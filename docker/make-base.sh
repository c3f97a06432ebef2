#!/usr/bin/env bash
# Make a local stand-in for `docker.io/library/python:3.11-slim-bookworm` where no image registry can be reached:
# Debian bookworm (minbase) with python3 3.11, venv and pip, imported into podman as
# localhost/debian-py:bookworm. It also carries this machine's CA bundle, since pip inside a
# build may reach PyPI through a proxy with its own certificate authority.
#
#   bash docker/make-base.sh [IMAGE]        # as root; needs podman and debootstrap (~5 min, ~300 MB)
#
# On a host that can pull from Docker Hub none of this is needed: the Dockerfiles' defaults
# (docker.io/library/python:3.11-slim-bookworm, docker.io/library/debian:bookworm-slim) are used.
set -euo pipefail
IMAGE=${1:-localhost/debian-py:bookworm}
P=(podman --runtime runc --cgroup-manager=cgroupfs)
if "${P[@]}" image exists "$IMAGE"; then
    echo "$IMAGE exists"
    exit 0
fi
# The Debian mirror apt uses on this machine.
MIRROR=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
    | awk '{print $2}' | grep -E '/debian/?$' | head -n1 || true)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
# pip's own CA bundle setting (`pip config list`), else the system's.
CA=$(pip config list 2>/dev/null | sed -nE "s/^[^=]*\.cert='(.*)'$/\1/p" | head -n1 || true)
CA=${CA:-/etc/ssl/certs/ca-certificates.crt}
ROOTFS=$(mktemp -d /var/tmp/pagoda-base.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR"
cp "$CA" "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" -c . | "${P[@]}" import --change 'CMD ["python3"]' - "$IMAGE"
echo "made $IMAGE"
