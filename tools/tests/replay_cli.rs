//! `vmpool-replay` as a user runs it, on the host backend.

use std::process::Command;

/// A trace whose last allocation is never freed, replayed three times: each
/// pass frees what the trace left live, so passes 2 and 3 start from an idle
/// pool, and the report covers every pass.
#[test]
fn passes_replay_the_trace_again_on_the_same_pool() {
    let path = temp_trace(
        "passes.trace",
        "a 1 3145728 1\na 2 40000000 1\nf 1 1\na 3 1000 1\nf 2 1\n",
    );
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_vmpool-replay"))
            .args(["--backend", "host", "--json"])
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
    let fixed = run(&["--passes", "3", "--defragment", "off"]);
    assert_eq!(fixed["remaps"], 0);
    assert!(fixed["allocator"]
        .as_str()
        .unwrap()
        .contains("no defragmentation"));
    // No pass is not a run.
    let zero = Command::new(env!("CARGO_BIN_EXE_vmpool-replay"))
        .args(["--backend", "host", "--passes", "0"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!zero.status.success());
    std::fs::remove_file(&path).unwrap();
}

/// Growth chunks scale with the pool by default (2 MiB granules while it is
/// small), `--chunk-divisor off` grows by whole 32 MiB chunks, a divisor of
/// 0 is refused, and `--va-size` sets the reservation.
#[test]
fn chunk_divisor_defaults_to_the_librarys_and_can_be_off() {
    // 40 MB on an empty pool: 20 granules, or two 32 MiB chunks.
    let path = temp_trace("divisor.trace", "a 1 40000000 1\nf 1 1\n");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_vmpool-replay"))
            .args(["--backend", "host", "--json"])
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
    // Sizes take units: 16 MiB chunks, or granules below 1 GiB.
    assert_eq!(
        chunks(&["--chunk-divisor", "off", "--chunk-size", "16MiB"]),
        3
    );
    assert_eq!(
        chunks(&["--chunk-divisor", "4", "--granule-growth-below", "1G"]),
        20
    );
    // The reservation as asked: 40 MB does not fit in 32 MiB of it.
    let small = run(&["--va-size", "32MiB"]);
    assert!(!small.status.success());
    assert!(
        String::from_utf8_lossy(&small.stderr).contains("address space"),
        "{}",
        String::from_utf8_lossy(&small.stderr)
    );
    assert_eq!(chunks(&["--va-size", "1G"]), 20);
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

/// Growth bridges the holes between free blocks for a large request
/// (Note [Growth and remapping], "Bridges"), moving some free units into
/// the holes and releasing others in the same growth. The GQA trace,
/// replayed synchronously with a mark at each pass, 2 MiB held
/// throughout (so that the pool never empties and starts afresh) and
/// growth chunks of a 512th, does both as its step layout's region is
/// allocated, where releasing first left the heap's block ids stale for
/// the moves that followed, and the replay panicked. (Stream-ordered at
/// chunks of 32 MiB it did so too, until the pool gathered its free
/// regions at marks: Note [Growth and remapping], "Gathering at marks".)
/// The third pass ends 0.0028 above the first, at main's figures before
/// the gathering too; the fourth maps nothing and ends where the third
/// did.
#[test]
fn a_bridge_that_moves_and_releases_runs_through() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../traces/gqa_decoder_train_torch.trace.gz"
    );
    let report = replay_json(&[
        "--backend",
        "host",
        "--json",
        "--passes",
        "4",
        "--mark-passes",
        "--hold",
        "2MiB",
        "--chunk-divisor",
        "512",
        trace,
    ]);
    assert!(
        report["chunks_released"].as_u64().unwrap() > 0,
        "no bridge released a unit: the case is not covered ({report})"
    );
    let ratios: Vec<f64> = serde_json::from_value(report["pass_ratios"].clone()).unwrap();
    let maps: Vec<u64> = serde_json::from_value(report["pass_maps"].clone()).unwrap();
    assert!(
        ratios[2] - ratios[0] <= 0.003 && ratios[3] == ratios[2] && maps[3] == 0,
        "the footprint crept: {ratios:?}, chunks mapped a pass {maps:?}"
    );
}

/// A long run whose tensors change size every step gathers its whole free
/// regions into one range at the marks after steps that created chunks,
/// and joins its free units into larger chunks where steps keep moving
/// them (Note [Growth and remapping], "Gathering at marks", "Joining where
/// steps keep moving units"): the mixture of experts, 300 steps
/// stream-ordered at the C layer's 1024th, ends at 1.0167 of its peak
/// (1.0254 with neither) and maps in no step after step 108 (in every
/// step without joining).
#[test]
fn a_long_run_gathers_and_joins_at_marks_then_settles() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../traces/moe_train_torch_marked300.trace.gz"
    );
    let report = replay_json(&[
        "--backend",
        "host",
        "--json",
        "--stream-ordered",
        "--chunk-divisor",
        "1024",
        trace,
    ]);
    assert!(report["gathers"].as_u64().unwrap() > 0, "{report}");
    assert!(report["joins"].as_u64().unwrap() > 0, "{report}");
    let ratio = report["ratio"].as_f64().unwrap();
    assert!(ratio < 1.02, "{ratio}");
    let step_maps: Vec<u64> = serde_json::from_value(report["step_maps"].clone()).unwrap();
    let late: Vec<usize> = (150..step_maps.len())
        .filter(|&s| step_maps[s] > 0)
        .collect();
    assert!(
        late.is_empty(),
        "steps that mapped after step 150: {late:?}"
    );
}

/// A trace replayed again and again on one pool, each pass a new model on
/// it (the pool empty in between), ends where its first pass did (Note
/// [Starting afresh]); with 2 MiB held throughout, the pool never empties,
/// and ViT's trace creeps as it did before the pool started afresh; so it
/// does with `--fresh-start never`.
#[test]
fn passes_on_an_emptied_pool_end_where_the_first_did() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../traces/vit_train_torch.trace.gz"
    );
    let ratios = |held: &[&str]| -> Vec<f64> {
        let args = [
            &[
                "--backend",
                "host",
                "--json",
                "--stream-ordered",
                "--passes",
                "5",
            ],
            held,
            &[trace],
        ]
        .concat();
        let report = replay_json(&args);
        serde_json::from_value(report["pass_ratios"].clone()).unwrap()
    };
    let fresh = ratios(&[]);
    assert_eq!(fresh.first(), fresh.last(), "{fresh:?}");
    let held = ratios(&["--hold", "2MiB"]);
    assert!(held[4] > held[0] + 0.01, "{held:?}");
    // 1.0107 to 1.0198 over five passes.
    let kept = ratios(&["--fresh-start", "never"]);
    assert!(kept[4] > kept[0] + 0.005, "{kept:?}");
}

/// `--stream-lag` keeps the stream behind the calls: each allocation's
/// queued work is waited for as the replay goes, so the replay takes at
/// least the delays' sum, and the same calls are made. It needs stream
/// order and three numbers above zero.
#[test]
fn a_lagging_stream_is_waited_for_and_asks_for_stream_order() {
    let pairs = 50;
    let lines: String = (0..pairs)
        .map(|i| format!("a 1 {} 1\nf 1 1\n", (i % 5 + 1) << 20))
        .collect();
    let path = temp_trace("lag.trace", lines);
    let trace = path.to_str().unwrap();
    let run = |lag: &[&str]| {
        let mut args = vec!["--backend", "host", "--json", "--stream-ordered"];
        args.extend_from_slice(lag);
        args.push(trace);
        replay_json(&args)
    };
    let plain = run(&[]);
    // 1 ms after every allocation, waited for every 10 operations.
    let lagged = run(&["--stream-lag", "1000,1,10"]);
    assert_eq!(lagged["ops"], plain["ops"]);
    let nanos =
        |r: &serde_json::Value| r["ns_per_op"].as_f64().unwrap() * r["ops"].as_f64().unwrap();
    assert!(
        nanos(&lagged) >= pairs as f64 * 1e6,
        "{} ns for {pairs} delays of 1 ms",
        nanos(&lagged)
    );
    assert!(nanos(&plain) < nanos(&lagged) / 2.0);
    let refused = |args: &[&str], says: &str| {
        let out = replay(args);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    };
    refused(
        &["--backend", "host", "--stream-lag", "100,20,200", trace],
        "needs --stream-ordered",
    );
    refused(
        &[
            "--backend",
            "host",
            "--stream-ordered",
            "--stream-lag",
            "100,0,200",
            trace,
        ],
        "EVERY must be a whole number above 0",
    );
    refused(
        &[
            "--backend",
            "host",
            "--stream-ordered",
            "--stream-lag",
            "100,20",
            trace,
        ],
        "three numbers",
    );
    std::fs::remove_file(&path).unwrap();
}

fn replay(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_vmpool-replay"))
        .args(args)
        .output()
        .unwrap()
}

/// The path of the trace `name` in the repository's `traces/`.
fn recorded_trace(name: &str) -> String {
    format!("{}/../traces/{name}.trace.gz", env!("CARGO_MANIFEST_DIR"))
}

/// Writes `contents` to a file of this process's own in the temporary
/// folder, `file` ending its name (the test removes it).
fn temp_trace(file: &str, contents: impl AsRef<[u8]>) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("vmpool-{}-{file}", std::process::id()));
    std::fs::write(&path, contents).unwrap();
    path
}

/// [`replay`] with `--json` among `args`, which must succeed: its report.
fn replay_json(args: &[&str]) -> serde_json::Value {
    let out = replay(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn answers_its_version() {
    let out = replay(&["--version"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("vmpool-replay "), "{text}");
}

/// A trace with nothing to replay is an error, said on one line, not a
/// ratio of NaN.
#[test]
fn a_trace_without_allocations_is_an_error() {
    for (name, text) in [("empty", ""), ("comments", "# a header\n# peak_live 0\n")] {
        let path = temp_trace(&format!("{name}.trace"), text);
        let out = replay(&["--backend", "host", "--json", path.to_str().unwrap()]);
        std::fs::remove_file(&path).unwrap();
        assert!(!out.status.success());
        assert!(
            out.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        let errors: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("vmpool-replay:"))
            .collect();
        assert_eq!(errors.len(), 1, "{stderr}");
        assert!(errors[0].contains("no allocation to replay"), "{stderr}");
    }
}

/// A truncated gzip trace names its file and its cause once.
#[test]
fn a_truncated_trace_says_why_once() {
    // A gzip header and the start of a deflate stream, then nothing.
    let path = temp_trace("cut.trace.gz", [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 0x4b]);
    let out = replay(&["--backend", "host", path.to_str().unwrap()]);
    std::fs::remove_file(&path).unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stderr
        .lines()
        .find(|l| l.starts_with("vmpool-replay:"))
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(line.contains("reading the trace"), "{stderr}");
    assert_eq!(stderr.matches("reading the trace").count(), 1, "{stderr}");
}

/// `--slack`: at the peak of GPT-2's generation trace, served by the
/// heap, every byte not live lies in units that also hold live bytes;
/// where a step layout's region is placed at the peak, its idle slots
/// count apart. The parts add up to the peak reserved; without the
/// option, no such report; and only vmpool has one.
#[test]
fn slack_at_the_peak_adds_up() {
    let slack_of = |trace: &str| {
        let report = replay_json(&["--backend", "host", "--json", "--slack", trace]);
        let slack = report["slack_at_peak"].clone();
        let bytes = |key: &str| slack[key].as_u64().unwrap();
        assert_eq!(bytes("reserved_bytes"), report["peak_reserved_bytes"]);
        let parts = [
            "used_bytes",
            "free_whole_units_bytes",
            "free_in_shared_units_bytes",
            "spare_bytes",
            "pending_bytes",
            "other_bytes",
        ];
        assert_eq!(
            parts.iter().map(|k| bytes(k)).sum::<u64>(),
            bytes("reserved_bytes"),
            "{slack}"
        );
        (report, slack)
    };
    let generation = recorded_trace("gpt2_generate");
    let (report, slack) = slack_of(&generation);
    let bytes = |key: &str| slack[key].as_u64().unwrap();
    // The peak live bytes, as the pool rounds each allocation up.
    let live = report["peak_live_bytes"].as_u64().unwrap();
    assert!(
        (live..live + (1 << 20)).contains(&bytes("used_bytes")),
        "{slack}"
    );
    assert!(bytes("free_in_shared_units_bytes") > 0, "{slack}");
    assert!(bytes("shared_units") > 0, "{slack}");
    // Part of them at the ends of the mapped regions, not all.
    assert!(
        (1..bytes("free_in_shared_units_bytes")).contains(&bytes("free_at_region_ends_bytes")),
        "{slack}"
    );
    assert!(bytes("regions") > 0, "{slack}");
    assert_eq!(bytes("other_bytes"), 0, "{slack}");
    // Steps whose region is placed beside allocations kept two steps
    // (not carried into the next alone, so the mark does not wait for
    // them): the pool grows for the region, which is idle as it peaks.
    let mib = 1u64 << 20;
    let mut text = String::new();
    for k in 0..8u64 {
        let (x, y, c) = (10 * k + 1, 10 * k + 2, 10 * k + 3);
        text += &format!(
            "a {x} {} 1\na {y} {} 1\nf {x} 1\nf {y} 1\n",
            8 * mib,
            8 * mib
        );
        text += &format!("a {c} {} 1\n", 8 * mib);
        if k >= 2 {
            text += &format!("f {} 1\n", 10 * (k - 2) + 3);
        }
        text += "s\n";
    }
    let kept = temp_trace("kept-two-steps.trace", text);
    let (laid_out, placed) = slack_of(kept.to_str().unwrap());
    std::fs::remove_file(&kept).unwrap();
    assert_eq!(laid_out["step_layouts"], 1, "{laid_out}");
    assert_eq!(
        placed["other_bytes"], laid_out["step_region_bytes"],
        "{placed}"
    );
    assert_eq!(placed["other_bytes"], 16 * mib, "{placed}");
    let plain = replay_json(&["--backend", "host", "--json", &generation]);
    assert!(plain["slack_at_peak"].is_null());
    assert_eq!(plain["ratio"], report["ratio"], "sampling moves nothing");
    let refused = replay(&[
        "--backend",
        "host",
        "--allocator",
        "cuda-async",
        "--slack",
        &generation,
    ]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--slack is for vmpool"));
}

/// `--mapping-ops` names the allocations after which the pool had mapped
/// chunks: on a small trace, the first large allocation and the one that
/// outgrows it, and the first small one (its arena's first unit), but
/// not a small one that fits beside it. Their chunks add up to the
/// replay's maps, over every pass, operations counted on across passes;
/// `--hold`'s allocation comes first, with no operation; only vmpool has
/// the list, and asking for it moves no figure.
#[test]
fn mapping_ops_add_up_to_the_maps() {
    let path = temp_trace(
        "mapping.trace",
        "a 1 3145728 1\na 2 40000000 1\nf 1 1\na 3 1000 1\na 4 2000 1\nf 2 1\n",
    );
    let trace = path.to_str().unwrap();
    let ops_of = |report: &serde_json::Value| -> Vec<(Option<u64>, u64, u64)> {
        report["mapping_ops"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let op = m["op"].as_u64();
                (op, m["size"].as_u64().unwrap(), m["maps"].as_u64().unwrap())
            })
            .collect()
    };
    let once = replay_json(&["--backend", "host", "--json", "--mapping-ops", trace]);
    let ops = ops_of(&once);
    let at: Vec<(Option<u64>, u64)> = ops.iter().map(|&(op, size, _)| (op, size)).collect();
    assert_eq!(
        at,
        [(Some(0), 3145728), (Some(1), 40000000), (Some(3), 1000)],
        "{once}"
    );
    assert!(ops.iter().all(|&(_, _, maps)| maps > 0));
    let total = |ops: &[(Option<u64>, u64, u64)]| ops.iter().map(|&(_, _, m)| m).sum::<u64>();
    assert_eq!(total(&ops), once["maps"].as_u64().unwrap());

    let twice = replay_json(&[
        "--backend",
        "host",
        "--json",
        "--mapping-ops",
        "--passes",
        "2",
        trace,
    ]);
    let ops = ops_of(&twice);
    assert_eq!(total(&ops), twice["maps"].as_u64().unwrap());
    assert!(ops.windows(2).all(|w| w[0].0 < w[1].0), "{twice}");
    assert!(ops.iter().all(|&(op, _, _)| op.unwrap() < 12), "{twice}");

    let held = replay_json(&[
        "--backend",
        "host",
        "--json",
        "--mapping-ops",
        "--hold",
        "2MiB",
        trace,
    ]);
    let ops = ops_of(&held);
    assert_eq!((ops[0].0, ops[0].1), (None, 2 << 20), "{held}");
    assert_eq!(total(&ops), held["maps"].as_u64().unwrap());

    let plain = replay_json(&["--backend", "host", "--json", trace]);
    assert!(plain["mapping_ops"].is_null());
    assert_eq!(plain["ratio"], once["ratio"], "listing moves nothing");
    assert_eq!(plain["maps"], once["maps"]);
    let refused = replay(&[
        "--backend",
        "host",
        "--allocator",
        "cuda-async",
        "--mapping-ops",
        trace,
    ]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--mapping-ops is for vmpool"));
    std::fs::remove_file(&path).unwrap();
}

/// The GAN's steps carry allocations across their marks: its marks wait
/// for their frees, and its layout's region no longer lies beside them
/// (under 1.01 of its peak, 1.0312 before). Torn down within a step, where
/// the marks now fall, each model laid out after it starts afresh and
/// ends where the first did, in stream order too.
#[test]
fn marks_wait_for_carried_frees_and_passes_repeat() {
    let gan = recorded_trace("gan_train_torch");
    for order in [None, Some("--stream-ordered")] {
        let mut args = vec!["--backend", "host", "--json", "--passes", "3"];
        args.extend(order);
        args.push(&gan);
        let report = replay_json(&args);
        let ratios: Vec<f64> = serde_json::from_value(report["pass_ratios"].clone()).unwrap();
        assert!(ratios[0] < 1.01, "{report}");
        assert!(ratios.iter().all(|r| *r == ratios[0]), "{report}");
    }
}
