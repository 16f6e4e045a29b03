//! `vmpool-replay` as a user runs it, on the host backend.

use std::process::Command;

/// A trace whose last allocation is never freed, replayed three times: each
/// pass frees what the trace left live, so passes 2 and 3 start from an idle
/// pool, and the report covers every pass.
#[test]
fn passes_replay_the_trace_again_on_the_same_pool() {
    let path = std::env::temp_dir().join(format!("vmpool-passes-{}.trace", std::process::id()));
    std::fs::write(
        &path,
        "a 1 3145728 1\na 2 40000000 1\nf 1 1\na 3 1000 1\nf 2 1\n",
    )
    .unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_vmpool-replay"))
            .arg("--json")
            .args(args)
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let one = run(&["--passes", "1"]);
    let three = run(&["--passes", "3"]);
    assert_eq!(one["passes"], 1);
    assert_eq!(three["passes"], 3);
    assert_eq!(three["ops"], 3 * one["ops"].as_u64().unwrap());
    let ratios: Vec<f64> = three["pass_ratios"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_f64().unwrap())
        .collect();
    assert_eq!(ratios.len(), 3);
    assert_eq!(ratios[0], one["ratio"].as_f64().unwrap());
    // A high-water mark: it never goes down, and the last is the report's.
    assert!(ratios.windows(2).all(|w| w[0] <= w[1]), "{ratios:?}");
    assert_eq!(ratios[2], three["ratio"].as_f64().unwrap());
    // Without defragmentation nothing moves.
    let fixed = run(&["--passes", "3", "--no-defragment"]);
    assert_eq!(fixed["remaps"], 0);
    assert!(fixed["allocator"]
        .as_str()
        .unwrap()
        .contains("no defragmentation"));
    // No pass is not a run.
    let zero = Command::new(env!("CARGO_BIN_EXE_vmpool-replay"))
        .args(["--passes", "0"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!zero.status.success());
    std::fs::remove_file(&path).unwrap();
}

/// Growth chunks scale with the pool by default (2 MiB granules while it is
/// small), `--chunk-divisor off` grows by whole 32 MiB chunks, and a
/// divisor of 0 is refused.
#[test]
fn chunk_divisor_defaults_to_the_librarys_and_can_be_off() {
    let path = std::env::temp_dir().join(format!("vmpool-divisor-{}.trace", std::process::id()));
    // 40 MB on an empty pool: 20 granules, or two 32 MiB chunks.
    std::fs::write(&path, "a 1 40000000 1\nf 1 1\n").unwrap();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_vmpool-replay"))
            .arg("--json")
            .args(args)
            .arg(&path)
            .output()
            .unwrap()
    };
    let chunks = |args: &[&str]| {
        let out = run(args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["chunks_created"]
            .as_u64()
            .unwrap()
    };
    let default = vmpool::DEFAULT_CHUNK_DIVISOR.to_string();
    assert_eq!(chunks(&[]), 20);
    assert_eq!(chunks(&["--chunk-divisor", &default]), 20);
    assert_eq!(chunks(&["--chunk-divisor", "off"]), 2);
    let zero = run(&["--chunk-divisor", "0"]);
    assert!(!zero.status.success());
    assert!(
        String::from_utf8_lossy(&zero.stderr)
            .contains("expected a whole number, at least 1, or off"),
        "{}",
        String::from_utf8_lossy(&zero.stderr)
    );
    std::fs::remove_file(&path).unwrap();
}
