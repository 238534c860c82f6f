#!/usr/bin/env bash
# Fetch kustomize (Debian trixie's package, a static binary) into a cache directory and print
# its path; tests/deploy/test_kubernetes.py renders the manifests with it.
#
#   deploy/k8s/get-kustomize.sh            # -> .cache/tools/kustomize
#   KUSTOMIZE_CACHE=/some/dir deploy/k8s/get-kustomize.sh
#
# Every download is checked: the suite's InRelease against the Debian archive keyring (gpgv),
# Packages.xz against the SHA256 that InRelease lists, the .deb against the SHA256 in
# Packages.xz. Nothing is installed system-wide; the binary is extracted with `dpkg-deb -x`.
set -euo pipefail

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=trixie
PACKAGE=kustomize
ARCH=amd64
KEYRING=${DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
CACHE=${KUSTOMIZE_CACHE:-$REPO/.cache/tools}
TARGET="$CACHE/kustomize"

if [ -x "$TARGET" ]; then
  echo "$TARGET"
  exit 0
fi
if [ "$(dpkg --print-architecture 2>/dev/null || true)" != "$ARCH" ]; then
  echo "get-kustomize: only $ARCH is fetched here; install kustomize yourself" >&2
  exit 1
fi
for tool in curl gpgv xz dpkg-deb sha256sum; do
  command -v "$tool" >/dev/null || { echo "get-kustomize: $tool is missing" >&2; exit 1; }
done
if [ ! -r "$KEYRING" ]; then
  echo "get-kustomize: no Debian archive keyring at $KEYRING (apt-get install debian-archive-keyring)" >&2
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fetch() { curl --fail --silent --show-error --location --retry 3 -o "$2" "$1"; }

# The suite's index, signed by the archive's release key.
fetch "$MIRROR/dists/$SUITE/InRelease" "$work/InRelease"
gpgv --quiet --keyring "$KEYRING" "$work/InRelease" 2>"$work/gpgv.log" || {
  cat "$work/gpgv.log" >&2
  echo "get-kustomize: $SUITE's InRelease does not verify against $KEYRING" >&2
  exit 1
}

# The package list, checked against the SHA256 section of InRelease.
list="main/binary-$ARCH/Packages.xz"
fetch "$MIRROR/dists/$SUITE/$list" "$work/Packages.xz"
want=$(awk -v f="$list" '/^SHA256:/{s=1; next} /^[^ ]/{s=0} s && $3 == f {print $1}' "$work/InRelease")
got=$(sha256sum "$work/Packages.xz" | cut -d' ' -f1)
if [ -z "$want" ] || [ "$want" != "$got" ]; then
  echo "get-kustomize: $list: sha256 $got, InRelease lists '${want}'" >&2
  exit 1
fi

# The package's stanza: where its .deb is and its SHA256.
xz -dc "$work/Packages.xz" >"$work/Packages"
awk -v p="$PACKAGE" '$0 == "Package: " p {s=1} s && /^$/ {exit} s' "$work/Packages" >"$work/stanza"
filename=$(awk '/^Filename: /{print $2}' "$work/stanza")
want=$(awk '/^SHA256: /{print $2}' "$work/stanza")
version=$(awk '/^Version: /{print $2}' "$work/stanza")
if [ -z "$filename" ] || [ -z "$want" ]; then
  echo "get-kustomize: no $PACKAGE in $SUITE's $list" >&2
  exit 1
fi

fetch "$MIRROR/$filename" "$work/package.deb"
got=$(sha256sum "$work/package.deb" | cut -d' ' -f1)
if [ "$want" != "$got" ]; then
  echo "get-kustomize: $filename: sha256 $got, Packages.xz lists $want" >&2
  exit 1
fi

dpkg-deb -x "$work/package.deb" "$work/root"
mkdir -p "$CACHE"
install -m 0755 "$work/root/usr/bin/kustomize" "$TARGET.partial"
mv "$TARGET.partial" "$TARGET"
echo "get-kustomize: $PACKAGE $version from $SUITE, sha256 $got" >&2
echo "$TARGET"
