#!/usr/bin/env bash
# Builds heteroserve's image where no image registry is reachable: the base is a Debian bookworm root made by
# debootstrap and brought in as a tarball on `FROM scratch`; the x86 CPU torch wheel comes from pip's find-links.
#
#   bash scripts/build-image.sh [amd64|arm64]      -> heteroserve:0.1.0-<arch> (and heteroserve:0.1.0 on amd64)
#
# With internet access, skip this script: `docker buildx build --platform linux/amd64,linux/arm64 .` starts
# from the official debian:bookworm-slim (docs/DEPLOYMENT.md). arm64 builds here run under qemu binfmt.
# Needs root (debootstrap), a running Docker engine with BuildKit, and the torch wheel for amd64 in
# pip's find-links (PIP_FIND_LINKS or `pip config get global.find-links`).
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=${1:-amd64}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
BASE=heteroserve-base:bookworm-$ARCH
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DOCKER=${DOCKER:-docker}
# A Docker CLI without the buildx plugin builds with BuildKit only through the engine's own builder.
if ! $DOCKER buildx version >/dev/null 2>&1 && [ -x /usr/bin/docker ]; then DOCKER=/usr/bin/docker; fi

# The base image: the root's tarball ADDed to `FROM scratch` built for the target platform (`docker import`
# would record this host's architecture in Docker 20.10, and BuildKit then looks for an arm64 base in a registry).
if [ "$($DOCKER image inspect --format '{{.Architecture}}' "$BASE" 2>/dev/null)" != "$ARCH" ]; then
    root=$(mktemp -d /var/tmp/heteroserve-base-XXXX)
    context=$(mktemp -d /var/tmp/heteroserve-base-context-XXXX)
    echo "debootstrap --arch=$ARCH bookworm -> $root"
    nice -n 10 debootstrap --arch="$ARCH" --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$root" "$MIRROR" >/dev/null
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" --numeric-owner -cf "$context/rootfs.tar" .
    printf 'FROM scratch\nADD rootfs.tar /\nCMD ["/bin/bash"]\n' >"$context/Dockerfile"
    DOCKER_BUILDKIT=1 $DOCKER build --platform "linux/$ARCH" -t "$BASE" "$context"
    rm -rf "$root" "$context"
fi

mkdir -p build/wheels
if [ "$ARCH" = amd64 ] && ! ls build/wheels/torch-2.13.0+cpu-*x86_64.whl >/dev/null 2>&1; then
    links=${PIP_FIND_LINKS:-$(pip config get global.find-links 2>/dev/null || true)}
    wheel=$(ls "${links:-/nonexistent}"/torch-2.13.0+cpu-cp311-*x86_64.whl 2>/dev/null | head -1 || true)
    [ -n "$wheel" ] || { echo "no torch 2.13.0+cpu wheel in pip's find-links ('$links')" >&2; exit 1; }
    cp "$wheel" build/wheels/
fi

secret=()
[ -s /etc/ssl/certs/ca-certificates.crt ] && secret=(--secret id=pip-cert,src=/etc/ssl/certs/ca-certificates.crt)
tags=(-t "heteroserve:$VERSION-$ARCH")
[ "$ARCH" = amd64 ] && tags+=(-t "heteroserve:$VERSION")
DOCKER_BUILDKIT=1 nice -n 10 $DOCKER build --platform "linux/$ARCH" --network host --build-arg BASE_IMAGE="$BASE" \
    "${secret[@]}" "${tags[@]}" .
$DOCKER image ls "heteroserve:$VERSION-$ARCH"
