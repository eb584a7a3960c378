#!/usr/bin/env bash
# Install dmi-sglang with SGLang 0.5.19 on a GPU host that has no package index: build a
# wheelhouse (a directory of wheels) where PyPI is reachable, copy it to the host, install
# it there. docs/gpu.md.
#
#   bash scripts/wheelhouse.sh build DIR
#       On a machine with PyPI (any OS; python3 with pip): downloads every wheel pinned in
#       scripts/gpu-wheels.txt for CPython 3.12 on x86_64 Linux (manylinux) into DIR, builds
#       this checkout's wheel into DIR and writes DIR/SHA256SUMS.
#   bash scripts/wheelhouse.sh install DIR [--target PATH]
#       On the GPU host: checks DIR against DIR/SHA256SUMS, installs every wheel in DIR with
#       pip (no index, no dependency resolution) into the environment of python3, or into
#       the directory PATH, then imports torch, sglang and dmi_sglang and prints their
#       versions. With --target, put PATH first on PYTHONPATH before using it.
#
# PYTHON=/path/to/python picks another interpreter than python3 for either step.
# Exit status: 0 done; 1 a step failed (one line on stderr says which); 2 bad arguments.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
LOCK="$HERE/gpu-wheels.txt"
PY="${PYTHON:-python3}"

usage() {  # usage [STATUS]: the usage text, on stdout for --help and on stderr otherwise
    local text
    text="usage: bash scripts/wheelhouse.sh build DIR
       bash scripts/wheelhouse.sh install DIR [--target PATH]

  build DIR      on a machine with PyPI: download the wheels of scripts/gpu-wheels.txt
                 (CPython 3.12, x86_64 Linux) and this project's wheel into DIR
  install DIR    on the GPU host, without an index: install every wheel in DIR into the
                 environment of python3 (\$PYTHON), or with --target PATH into PATH,
                 then check that torch, sglang and dmi_sglang import
See docs/gpu.md."
    if [ "${1:-2}" = 0 ]; then echo "$text"; exit 0; fi
    echo "$text" >&2
    exit "${1:-2}"
}
die() { echo "wheelhouse: $*" >&2; exit 1; }
bad() { echo "wheelhouse: $*" >&2; usage 2; }  # bad arguments: what is wrong, then usage
say() { printf '[wheelhouse %4ss] %s\n' "$SECONDS" "$*"; }

need_python() {
    command -v "$PY" >/dev/null 2>&1 || die "$PY: not found (set PYTHON to an interpreter with pip)"
    "$PY" -m pip --version >/dev/null 2>&1 || die "$PY has no pip (try: $PY -m ensurepip)"
}

# Python helpers, run by "$PY" so that the script needs no sha256sum/shasum of its own.
# SHA256_PY: the file digest that SUMS_PY and CHECK_PY use (it is prepended to them).
SHA256_PY='
import hashlib
def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
'
# `sums DIR LOCK`: checks that DIR holds exactly one wheel per pin of LOCK plus one
# dmi_sglang wheel and nothing else, then writes DIR/SHA256SUMS.
SUMS_PY='
import pathlib, re, sys
d, lock = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
normv = lambda version: re.sub(r"(?<![0-9])0+(?=[0-9])", "", version.lower())
pins = {}
for line in lock.read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
        name, _, version = line.partition("==")
        pins[norm(name)] = normv(version)
found, extra = {}, []
for whl in sorted(d.glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    if norm(name) == "dmi-sglang" or pins.get(norm(name)) == normv(version):
        found.setdefault(norm(name), []).append(whl.name)
    else:
        extra.append(whl.name)
missing = sorted((set(pins) | {"dmi-sglang"}) - set(found))
twice = sorted(n for n, files in found.items() if len(files) > 1)
if missing or extra or twice:
    sys.exit("wheelhouse: " + "; ".join(filter(None, [
        missing and "no wheel for " + ", ".join(missing),
        extra and "wheels the lock does not pin (an older build? use an empty DIR): "
        + ", ".join(extra),
        twice and "more than one wheel of " + ", ".join(twice)])))
lines = []
for files in found.values():
    for name in files:
        lines.append(sha256(d / name) + "  " + name)
(d / "SHA256SUMS").write_text("\n".join(sorted(lines, key=lambda s: s[66:])) + "\n")
print(len(lines))
'
# `check DIR`: DIR/SHA256SUMS against the files, and the interpreter against the wheels'
# CPython ABI tags (abi3 and none fit any): a cp312 wheel on another Python is refused
# here in one line, not by pip.
CHECK_PY='
import pathlib, sys
d = pathlib.Path(sys.argv[1])
here = "cp%d%d" % sys.version_info[:2]
tags = {t for w in d.glob("*.whl") for t in w.name.split("-")[-2].split(".")
        if t.startswith("cp")}
if tags and here not in tags:
    sys.exit("wheelhouse: the wheels in %s are for %s; %s is Python %d.%d (set PYTHON)"
             % (d, "/".join(sorted(tags)), sys.executable, *sys.version_info[:2]))
sums = d / "SHA256SUMS"
if not sums.is_file():
    print("no SHA256SUMS in %s: the copy is not checked" % d)
    sys.exit(0)
bad = []
for line in sums.read_text().splitlines():
    digest, _, name = line.partition("  ")
    f = d / name
    if not f.is_file() or sha256(f) != digest:
        bad.append(name)
if bad:
    sys.exit("wheelhouse: %d file(s) missing or changed since the build (copy %s again): %s"
             % (len(bad), d, ", ".join(bad)))
print("SHA256SUMS: %d wheels as built" % len(sums.read_text().splitlines()))
'
# The import check after an install: versions, the GPU, and the plugin's entry point (SGLang
# finds the plugin only through an installed dist-info, never through PYTHONPATH=src).
IMPORT_PY='
import importlib.metadata as md, sys
import torch, sglang, dmi_sglang
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device visible"
print("torch %s, sglang %s, dmi-sglang %s (%s); %s" % (
    torch.__version__, sglang.__version__, md.version("dmi-sglang"),
    dmi_sglang.__file__, gpu))
if "dmi" not in {e.name for e in md.entry_points(group="sglang.srt.plugins")}:
    sys.exit("wheelhouse: the sglang.srt.plugins entry point dmi is missing: install "
             "dmi-sglang as a wheel (its dist-info), not through PYTHONPATH=src")
'

cmd_build() {
    [ $# -eq 1 ] && [ -n "$1" ] && [ "${1#-}" = "$1" ] || bad "build takes one argument, DIR"
    local dir=$1 n m platforms=()
    [ -f "$LOCK" ] || die "$LOCK: no such file"
    need_python
    mkdir -p "$dir" 2>/dev/null || die "$dir: cannot create the directory"
    dir="$(cd "$dir" && pwd)"
    # Every manylinux tag an x86_64 glibc 2.39 host accepts, newest first, legacy names too.
    for m in $(seq 39 -1 17); do platforms+=(--platform "manylinux_2_${m}_x86_64"); done
    platforms+=(--platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64
                --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64
                --platform manylinux1_x86_64)
    n=$(grep -cvE '^[[:space:]]*(#|$)' "$LOCK")
    say "1/3 downloading the $n wheels pinned in scripts/gpu-wheels.txt (CPython 3.12, x86_64 Linux) into $dir"
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$dir" -r "$LOCK" \
        || die "pip download failed (above); DIR keeps what arrived, run build again to resume"
    say "2/3 building this project's wheel from $ROOT"
    rm -f "$dir"/dmi_sglang-*.whl
    (cd "$ROOT" && "$PY" -m pip wheel --no-deps -w "$dir" .) \
        || die "pip wheel of the project failed (above)"
    say "3/3 checking DIR against the lock, writing $dir/SHA256SUMS"
    n=$("$PY" -c "$SHA256_PY$SUMS_PY" "$dir" "$LOCK") || exit 1
    say "wheelhouse ready: $n wheels, $(du -sh "$dir" | cut -f1) in $dir"
    say "copy $dir to the GPU host, then there: bash scripts/wheelhouse.sh install DIR"
}

cmd_install() {
    local dir="" target="" wheels=() project=() others=() w args
    while [ $# -gt 0 ]; do
        case $1 in
            --target) [ $# -ge 2 ] && [ -n "$2" ] || bad "--target needs a PATH"
                      target=$2; shift 2 ;;
            --target=?*) target=${1#--target=}; shift ;;
            -*) bad "unknown option $1" ;;
            *) [ -z "$dir" ] && [ -n "$1" ] || bad "install takes one DIR"; dir=$1; shift ;;
        esac
    done
    [ -n "$dir" ] || bad "install needs the wheelhouse DIR"
    [ -d "$dir" ] || die "$dir: no such directory (make one with 'bash scripts/wheelhouse.sh build DIR' where PyPI is reachable, then copy it here)"
    shopt -s nullglob
    wheels=("$dir"/*.whl)
    shopt -u nullglob
    [ ${#wheels[@]} -gt 0 ] || die "$dir holds no wheels (*.whl): was 'bash scripts/wheelhouse.sh build DIR' run, and the whole DIR copied?"
    for w in "${wheels[@]}"; do
        case ${w##*/} in dmi_sglang-*) project+=("$w") ;; *) others+=("$w") ;; esac
    done
    need_python
    say "checking $dir"
    "$PY" -c "$SHA256_PY$CHECK_PY" "$dir" || exit 1
    args=(--no-index --no-deps --find-links "$dir")
    if [ -n "$target" ]; then
        mkdir -p "$target" 2>/dev/null || die "$target: cannot create the directory"
        target="$(cd "$target" && pwd)"
        args+=(--target "$target" --upgrade)
    fi
    if [ ${#others[@]} -gt 0 ]; then
        say "installing ${#others[@]} wheels into ${target:-the environment of $PY}"
        "$PY" -m pip install "${args[@]}" "${others[@]}" || die "pip install failed (above)"
    fi
    if [ ${#project[@]} -gt 0 ]; then
        # Every build of the project has the same version: reinstall it, never skip it.
        say "installing ${project[*]##*/}"
        "$PY" -m pip install "${args[@]}" --force-reinstall "${project[@]}" \
            || die "pip install of the project wheel failed (above)"
    else
        say "no dmi_sglang wheel in $dir: dmi-sglang must be installed already"
    fi
    if [ -n "$target" ]; then export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"; fi
    say "import check"
    "$PY" -c "$IMPORT_PY" || die "import check failed (above): is a package the lock leaves to the host missing? (scripts/gpu-wheels.txt, header)"
    if [ -n "$target" ]; then
        say "installed into $target; before using it: export PYTHONPATH=$target\${PYTHONPATH:+:\$PYTHONPATH}"
    else
        say "installed"
    fi
}

case ${1:-} in
    build) shift; cmd_build "$@" ;;
    install) shift; cmd_install "$@" ;;
    -h | --help | help) usage 0 ;;
    "") bad "no subcommand" ;;
    *) bad "unknown subcommand $1" ;;
esac
