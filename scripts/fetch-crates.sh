#!/usr/bin/env bash
# Make the crates groupmm depends on available to cargo.
#
# With crates.io reachable this does nothing. Where it is not (some build farms only
# reach PyPI and Debian's archive), it fetches Debian's packaged crate sources
# (librust-*-dev from Debian sid), unpacks them into vendor/crates and points cargo
# at that directory through .cargo/config.toml (both git-ignored).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
vendor="$root/vendor/crates"
if [ "${GROUPMM_VENDOR:-auto}" != "1" ] && curl -fsS -m 8 -o /dev/null https://index.crates.io/config.json 2>/dev/null; then
  echo "fetch-crates: crates.io is reachable; nothing to do"
  exit 0
fi
if [ -f "$vendor/.complete" ] && [ -f "$root/.cargo/config.toml" ]; then
  echo "fetch-crates: $vendor already populated"
  exit 0
fi
# Top-level crates we need; apt resolves everything they depend on.
crates="pyo3 numpy half ndarray rayon cxx cxx-build cc proptest approx criterion matrixmultiply thiserror libc"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
cat > "$work/sources.list" <<SRC
deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main
SRC
opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
      -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o APT::Architecture=amd64
      -o APT::Sandbox::User=root -q)
echo "fetch-crates: crates.io unreachable; fetching crate sources from Debian sid"
apt-get "${opts[@]}" update >/dev/null
pkgs=$(for c in $crates; do echo "librust-$c-dev"; done)
# shellcheck disable=SC2086
apt-cache "${opts[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts \
  --no-breaks --no-replaces --no-enhances $pkgs | grep -E '^librust-' | sort -u > "$work/closure"
(cd "$work/debs" && xargs apt-get "${opts[@]}" download < "$work/closure" >/dev/null)
rm -rf "$vendor"; mkdir -p "$vendor" "$work/x"
for f in "$work"/debs/*.deb; do
  dpkg-deb --fsys-tarfile "$f" | tar -x -C "$work/x" ./usr/share/cargo/registry 2>/dev/null || true
done
mv "$work"/x/usr/share/cargo/registry/* "$vendor"/
mkdir -p "$root/.cargo"
cat > "$root/.cargo/config.toml" <<CFG
# written by scripts/fetch-crates.sh: crates come from Debian's packaged sources
[source.crates-io]
replace-with = "debian-vendor"
[source.debian-vendor]
directory = "$vendor"
[net]
offline = true
CFG
touch "$vendor/.complete"
echo "fetch-crates: $(ls "$vendor" | wc -l) crates in $vendor"
