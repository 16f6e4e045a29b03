//! The soak binary, for a few seconds on the host backend: every pattern
//! checked, memory back to its baseline at the end (it fails otherwise).

use std::process::Command;

#[test]
fn a_short_soak_ends_where_it_started() {
    let out = Command::new(env!("CARGO_BIN_EXE_vmpool-soak"))
        .args([
            "--backend",
            "host",
            "--seconds",
            "3",
            "--threads",
            "3",
            "--live-per-thread",
            "134217728",
            "--json",
        ])
        .output()
        .expect("running vmpool-soak");
    assert!(
        out.status.success(),
        "soak failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert!(report["allocations"].as_u64().unwrap() > 50, "{report}");
    assert_eq!(report["allocations"], report["frees"]);
    assert!(
        report["cross_stream_frees"].as_u64().unwrap() > 0,
        "{report}"
    );
    assert_eq!(report["device_free_before"], report["device_free_after"]);
}

/// Zero threads or zero seconds is not a soak: refused, not reported as a
/// success.
#[test]
fn zero_threads_or_seconds_are_refused() {
    for args in [["--threads", "0"], ["--seconds", "0"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_vmpool-soak"))
            .args(["--backend", "host"])
            .args(args)
            .output()
            .expect("running vmpool-soak");
        assert!(!out.status.success(), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_vmpool-soak"))
        .arg("--version")
        .output()
        .expect("running vmpool-soak");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("vmpool-soak "));
}
