#!/usr/bin/env bash
# Pushes heteroserve:VERSION-amd64 and -arm64 (scripts/build-image.sh) as one multi-arch tag: a manifest list
# made with buildah, for engines without the buildx plugin. `docker pull` then picks the host's architecture.
#
#   bash scripts/push-multiarch.sh registry.example.com/heteroserve:0.1.0 [--tls-verify=false]
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${1:?usage: push-multiarch.sh REGISTRY/NAME:TAG [buildah push flags]}
shift
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
LIST=heteroserve-multiarch-$VERSION
buildah manifest rm "$LIST" >/dev/null 2>&1 || true
buildah manifest create "$LIST" >/dev/null
for arch in amd64 arm64; do
    buildah manifest add "$LIST" "docker-daemon:heteroserve:$VERSION-$arch"
done
buildah manifest push --all "$@" "$LIST" "docker://$TARGET"
buildah manifest rm "$LIST" >/dev/null
