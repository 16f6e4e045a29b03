#!/usr/bin/env bash
# Checks that vmpool builds beside cudarc whatever CUDA version and linking
# mode the program picks: for each VERSION[:MODE] argument (default: two
# versions, dynamic loading), a scratch crate depending on vmpool (path,
# feature `cudarc`) and on cudarc 0.19 with those features runs `cargo
# check`. Needs crates.io; no CUDA install, no GPU.
#
#   scripts/check_cudarc.sh                          # cuda-12080 and cuda-13000
#   scripts/check_cudarc.sh cuda-12080:dynamic-linking
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
combos=("$@")
if [ ${#combos[@]} -eq 0 ]; then
    combos=(cuda-12080:dynamic-loading cuda-13000:dynamic-loading)
fi
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
# One target folder for every combination: vmpool's own crates build once.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target/check-cudarc}"

for combo in "${combos[@]}"; do
    version="${combo%%:*}"
    mode="dynamic-loading"
    [ "$combo" != "$version" ] && mode="${combo#*:}"
    crate="$scratch/$version-$mode"
    mkdir -p "$crate/src"
    cat >"$crate/Cargo.toml" <<TOML
[package]
name = "vmpool-cudarc-check"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
vmpool = { path = "$root" }
cudarc = { version = "0.19", default-features = false, features = ["std", "driver", "$mode", "$version"] }

[workspace]
TOML
    cat >"$crate/src/main.rs" <<'RUST'
// Uses both crates, so that each is checked as the program sees it.
fn main() {
    let _ = cudarc::driver::CudaContext::new(0);
    let _ = vmpool::Context::new(vmpool::vmm::cuda::Cuda::new().expect("driver"));
}
RUST
    echo "== vmpool beside cudarc ($version, $mode)"
    (cd "$crate" && cargo check --quiet)
done
echo "ok: vmpool builds beside cudarc in every combination"
