#!/usr/bin/env bash
# Make the crates pinned in Cargo.lock available to cargo.
#
# 1. vendor/crates already fetched by an earlier run: check that it still satisfies
#    Cargo.lock and stop (no network).
# 2. Ask cargo itself whether the Rust package registry is reachable: a short, time-limited
#    `cargo update --dry-run` with a throw-away CARGO_HOME, run outside the repository so
#    that neither ~/.cargo nor this repository's .cargo/config.toml (the source replacement
#    written below) applies. If it resolves, cargo can fetch the crates itself: do nothing.
# 3. Otherwise (some build farms only reach PyPI and Debian's archive) fetch Debian's
#    packaged crate sources (librust-*-dev) from the Debian mirror this machine's apt
#    configuration names, unpack them into vendor/crates, point cargo at that directory
#    through .cargo/config.toml (both git-ignored), and check that they satisfy Cargo.lock;
#    if they do not, say which crate and version is missing.
#
# Env: GROUPMM_VENDOR=1 skips the registry probe and always vendors from Debian;
#      GROUPMM_DEBIAN_MIRROR=<archive URI> overrides the mirror read from apt's sources;
#      GROUPMM_DEBIAN_SUITE (default sid, see below); PYTHON (default python3).
# To go back to the registry after vendoring: rm -rf vendor .cargo
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
vendor="$root/vendor/crates"
config="$root/.cargo/config.toml"
PY=${PYTHON:-python3}
# The suite is Debian's `sid` (unstable), whatever release this machine runs: stable
# releases package crates far older than the ones Cargo.lock pins (bookworm, for one, has
# pyo3 0.17 and no ndarray; groupmm needs pyo3 0.28 and ndarray 0.17). Only the mirror
# comes from the machine's apt configuration; every Debian mirror carries sid.
suite=${GROUPMM_DEBIAN_SUITE:-sid}

# The parts that parse files: apt's sources, Cargo.lock, the vendored manifests.
helper() {
  "$PY" - "$@" <<'PY'
import json, os, re, sys

def lock_packages(path):
    """(name, version) -> checksum or None, for every registry package of Cargo.lock."""
    out = {}
    if not os.path.exists(path):
        return out
    for block in open(path, encoding="utf-8").read().split("[[package]]")[1:]:
        f = dict(re.findall(r'^(\w+) = "([^"]*)"', block, re.M))
        if f.get("source", "").startswith("registry+"):
            out[(f["name"], f["version"])] = f.get("checksum")
    return out

def vendored(vendor):
    """(name, version) -> directory, read from each vendored crate's Cargo.toml."""
    out = {}
    for d in sorted(os.listdir(vendor)):
        p = os.path.join(vendor, d, "Cargo.toml")
        if not os.path.isfile(p):
            continue
        text = open(p, encoding="utf-8").read()
        pkg = re.search(r'^\[package\]\s*$(.*?)(?=^\[|\Z)', text, re.M | re.S)
        body = pkg.group(1) if pkg else ""
        name = re.search(r'^name = "([^"]+)"', body, re.M)
        ver = re.search(r'^version = "([^"]+)"', body, re.M)
        if name and ver:
            out[(name.group(1), ver.group(1))] = os.path.join(vendor, d)
    return out

def mirrors():
    """Debian archive URIs named by apt's sources, those of the machine's own release first."""
    sl, sp = sys.argv[2], sys.argv[3]
    files = [sl] if os.path.isfile(sl) else []
    if os.path.isdir(sp):
        files += [os.path.join(sp, f) for f in sorted(os.listdir(sp))
                  if f.endswith((".list", ".sources"))]
    entries = []  # (uri, suites)
    for path in files:
        text = open(path, encoding="utf-8", errors="replace").read()
        if path.endswith(".sources"):  # deb822 stanzas
            for stanza in re.split(r"\n\s*\n", text):
                fields, key = {}, None
                for line in stanza.splitlines():
                    if line.startswith("#"):
                        continue
                    if line[:1].isspace() and key:
                        fields[key] += " " + line.strip()
                    elif ":" in line:
                        key, val = line.split(":", 1)
                        key = key.strip().lower()
                        fields[key] = val.strip()
                if fields.get("enabled", "yes").lower() == "no":
                    continue
                if "deb" not in fields.get("types", "").split():
                    continue
                for uri in fields.get("uris", "").split():
                    entries.append((uri, fields.get("suites", "").split()))
        else:  # one-line format
            for line in text.splitlines():
                line = line.split("#", 1)[0]
                line = re.sub(r"\[[^\]]*\]", " ", line).split()
                if len(line) >= 3 and line[0] == "deb":
                    entries.append((line[1], [line[2]]))
    codename = ""
    if os.path.isfile("/etc/os-release"):
        m = re.search(r'^VERSION_CODENAME="?([^"\n]*)', open("/etc/os-release").read(), re.M)
        codename = m.group(1) if m else ""
    entries = [e for e in entries if re.match(r"^(https?|mirror\+\w+)://", e[0])]
    entries.sort(key=lambda e: codename not in e[1])  # stable: file order otherwise
    seen = set()
    for uri, _ in entries:
        if uri.rstrip("/") not in seen:
            seen.add(uri.rstrip("/"))
            print(uri)

def seeds():
    """Debian package names for every crate that Cargo.toml or Cargo.lock names."""
    manifest, lock, known = sys.argv[2], sys.argv[3], set(open(sys.argv[4]).read().split())
    crates = set()
    section = None
    for line in open(manifest, encoding="utf-8"):
        m = re.match(r"^\[(.*)\]\s*$", line)
        if m:
            section = m.group(1)
        elif section and section.endswith("dependencies"):
            m = re.match(r"^([A-Za-z0-9_-]+)\s*=", line)
            if m:
                crates.add((m.group(1), ""))
    crates |= set(lock_packages(lock))
    out = set()
    for name, version in crates:
        base = "librust-" + name.lower().replace("_", "-")
        parts = version.split(".")
        # Debian names the newest packaged major version librust-NAME-dev and older
        # ones librust-NAME-MAJOR-dev or librust-NAME-MAJOR.MINOR-dev.
        for cand in (base, f"{base}-{parts[0]}", f"{base}-{'.'.join(parts[:2])}"):
            if cand + "-dev" in known:
                out.add(cand + "-dev")
    print("\n".join(sorted(out)))

def normalize():
    """Make each vendored crate's recorded checksum agree with Cargo.lock, or say why not.

    A directory source reports the "package" field of .cargo-checksum.json as the crate's
    checksum, and cargo refuses a lock file whose checksum differs from it (in either
    direction: present/absent, or two values). Debian records the registry's checksum of
    the crate it packaged where its tooling knew it, and otherwise the placeholder string
    "Could not get crate checksum", which cargo would take for a checksum. Here: a real
    checksum that the lock contradicts is an error; otherwise the crate takes the lock's
    value (none where the lock has none); crates the lock does not pin keep a real checksum
    and drop the placeholder. Cargo never hashes a directory source's contents against
    this field (Debian lists no per-file checksums), so nothing is verified either way.
    """
    vendor, lock = sys.argv[2], sys.argv[3]
    pinned = lock_packages(lock)
    bad = []
    for (name, version), d in vendored(vendor).items():
        p = os.path.join(d, ".cargo-checksum.json")
        data = json.load(open(p)) if os.path.exists(p) else {"files": {}}
        have = data.get("package")
        real = have if isinstance(have, str) and re.fullmatch(r"[0-9a-f]{64}", have) else None
        if (name, version) in pinned:
            want = pinned[(name, version)]
            if real and want and real != want:
                bad.append(f"  {name} {version}: Cargo.lock records checksum {want},"
                           f" Debian's package records {real}")
                continue
        else:
            want = real
        if data.get("package", 0) != want:
            data["package"] = want
            with open(p, "w") as f:
                json.dump(data, f)
    if bad:
        print("fetch-crates: Debian's packaged crates do not match Cargo.lock:", file=sys.stderr)
        print("\n".join(bad), file=sys.stderr)
        sys.exit(1)

def missing():
    """Registry packages of Cargo.lock that vendor/crates lacks, with what it has instead."""
    vendor, lock = sys.argv[2], sys.argv[3]
    have = vendored(vendor)
    for (name, version) in sorted(lock_packages(lock)):
        if (name, version) not in have:
            others = sorted(v for (n, v) in have if n == name)
            alt = f"Debian {sys.argv[4]} has {', '.join(others)}" if others else \
                f"not packaged in Debian {sys.argv[4]}"
            print(f"  {name} {version} ({alt})")

{"mirrors": mirrors, "seeds": seeds, "normalize": normalize, "missing": missing}[sys.argv[1]]()
PY
}

# Does the vendored set satisfy Cargo.lock? Prints why not (crate and version) and fails.
check() {
  [ -f "$root/Cargo.lock" ] || return 0
  local gaps err
  gaps=$(helper missing "$vendor" "$root/Cargo.lock" "$suite")
  if [ -n "$gaps" ]; then
    echo "fetch-crates: Debian's packaged crates cannot satisfy Cargo.lock; missing:" >&2
    echo "$gaps" >&2
    return 1
  fi
  if ! err=$(cd "$root" && cargo metadata --locked --offline --format-version 1 2>&1 >/dev/null); then
    echo "fetch-crates: Debian's packaged crates cannot satisfy Cargo.lock." >&2
    echo "cargo would change the lock file like this:" >&2
    (cd "$root" && cargo update --workspace --offline --dry-run 2>&1 |
      grep -E '^ *(Adding|Updating|Removing|Downgrading|Unchanged)' >&2) || true
    echo "cargo said:" >&2
    echo "$err" | sed 's/^/  /' >&2
    return 1
  fi
}

if [ -f "$vendor/.complete" ] && [ -f "$config" ]; then
  if helper normalize "$vendor" "$root/Cargo.lock" && check; then
    echo "fetch-crates: $vendor already populated and satisfies Cargo.lock"
    exit 0
  fi
  echo "fetch-crates: fetching the crate sources again" >&2
elif [ "${GROUPMM_VENDOR:-auto}" != "1" ]; then
  probe=$(mktemp -d)
  if (cd "$probe" && CARGO_HOME="$probe/home" CARGO_NET_OFFLINE=false CARGO_NET_RETRY=0 \
      CARGO_HTTP_TIMEOUT=15 timeout 60 cargo update --dry-run --quiet \
      --manifest-path "$root/Cargo.toml") >/dev/null 2>&1; then
    rm -rf "$probe"
    echo "fetch-crates: the Rust package registry is reachable; nothing to do"
    exit 0
  fi
  rm -rf "$probe"
fi

if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
  echo "fetch-crates: the Rust package registry is unreachable, and without apt-get and" >&2
  echo "dpkg-deb Debian's packaged crate sources cannot be fetched instead." >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs" "$work/x"
arch=$(dpkg --print-architecture)
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
signed=""
[ -f "$keyring" ] && signed="[signed-by=$keyring] "
opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
      -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache"
      -o "APT::Architecture=$arch" -o APT::Sandbox::User=root -q)
if [ -n "${GROUPMM_DEBIAN_MIRROR:-}" ]; then
  candidates=$GROUPMM_DEBIAN_MIRROR
else
  eval "$(apt-config shell SL Dir::Etc::sourcelist/f SP Dir::Etc::sourceparts/d)"
  candidates=$(helper mirrors "${SL:-/etc/apt/sources.list}" "${SP:-/etc/apt/sources.list.d}")
fi
# The first source whose $suite release apt can fetch and verify against Debian's archive
# key is the mirror (security and third-party sources have no signed sid and fail here).
mirror=""
for uri in $candidates; do
  echo "deb $signed$uri $suite main" > "$work/sources.list"
  if apt-get "${opts[@]}" update >/dev/null 2>&1 &&
    [ -n "$(apt-get "${opts[@]}" indextargets --format '$(FILENAME)' 'Identifier: Packages')" ]; then
    mirror=$uri
    break
  fi
done
if [ -z "$mirror" ]; then
  echo "fetch-crates: the Rust package registry is unreachable and no Debian mirror in this" >&2
  echo "machine's apt sources serves a signed '$suite' release (tried: ${candidates:-none})." >&2
  echo "Set GROUPMM_DEBIAN_MIRROR to a Debian archive URI, or give cargo registry access." >&2
  exit 1
fi
echo "fetch-crates: fetching crate sources from Debian $suite ($mirror)"
apt-cache "${opts[@]}" pkgnames librust- > "$work/known"
helper seeds "$root/Cargo.toml" "$root/Cargo.lock" "$work/known" > "$work/seeds"
# apt resolves everything the seeds depend on.
# shellcheck disable=SC2046
apt-cache "${opts[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts \
  --no-breaks --no-replaces --no-enhances $(cat "$work/seeds") |
  grep -E '^librust-' | sort -u > "$work/closure"
(cd "$work/debs" && xargs apt-get "${opts[@]}" download < "$work/closure" >/dev/null)
for f in "$work"/debs/*.deb; do
  dpkg-deb --fsys-tarfile "$f" | tar -x -C "$work/x" ./usr/share/cargo/registry 2>/dev/null || true
done
rm -rf "$vendor"
mkdir -p "$(dirname "$vendor")"
mv "$work/x/usr/share/cargo/registry" "$vendor"
mkdir -p "$root/.cargo"
cat > "$config" <<CFG
# written by scripts/fetch-crates.sh: crates come from Debian's packaged sources
[source.crates-io]
replace-with = "debian-vendor"
[source.debian-vendor]
directory = "$vendor"
[net]
offline = true
CFG
touch "$vendor/.complete"
echo "fetch-crates: $(find "$vendor" -mindepth 1 -maxdepth 1 -type d | wc -l) crates in $vendor"
helper normalize "$vendor" "$root/Cargo.lock"
check
