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
vmpool = { path = "$root", features = ["cudarc"] }
cudarc = { version = "0.19", default-features = false, features = ["std", "driver", "$mode", "$version"] }

[workspace]
TOML
    cat >"$crate/src/main.rs" <<'RUST'
// Uses both crates together, so that the interop is checked as a program
// sees it (never run).
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use vmpool::vmm::cuda::Cuda;
use vmpool::{Buffer, Context};

fn main() {
    if std::env::args().count() > 99 {
        let _ = interop(None);
    }
}

fn interop(f: Option<&CudaFunction>) -> Result<(), Box<dyn std::error::Error>> {
    let ctx = Context::new(Cuda::new()?)?;
    let cu = CudaContext::new(0)?;
    let cu_stream = cu.new_stream()?;
    let stream = ctx.adopt_cudarc_stream(&cu_stream)?;
    let mut x: Buffer<f32, Cuda> = ctx.alloc_buffer(16, &stream)?;
    cu_stream.memcpy_htod(&[1.0f32; 16], &mut x)?;
    let f = f.ok_or("no kernel")?;
    let mut launch = cu_stream.launch_builder(f);
    launch.arg(&mut x);
    // SAFETY: never run; this checks that the types line up.
    unsafe { launch.launch(LaunchConfig::for_num_elems(16)) }?;
    let _back: Vec<f32> = cu_stream.clone_dtoh(&x)?;
    let _handle: usize = stream.raw().handle();
    Ok(())
}
RUST
    echo "== vmpool beside cudarc ($version, $mode)"
    (cd "$crate" && cargo check --quiet)
done
echo "ok: vmpool builds beside cudarc in every combination"
