//! The Python package's ctypes layer (the part that needs no PyTorch),
//! through `scripts/vmpool_torch.py`, the name older scripts import it by,
//! against the library this build made, on the host backend. The package's
//! own tests are python/tests (pytest); the PyTorch part runs on the GPU
//! (`scripts/pytorch_compare.py`).

use std::path::PathBuf;
use std::process::Command;

/// The library `cargo test` built beside this test, in target/<profile>/deps
/// (`cargo build` also copies it up to target/<profile>).
fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().join("libvmpool_c.so");
    assert!(lib.is_file(), "{} was not built", lib.display());
    lib
}

/// `scripts/vmpool_torch.py`, and the package it imports.
const HELPER: &str = include_str!("../../scripts/vmpool_torch.py");
const PACKAGE: [(&str, &str); 6] = [
    (
        "__init__.py",
        include_str!("../../python/vmpool/__init__.py"),
    ),
    (
        "_iterations.py",
        include_str!("../../python/vmpool/_iterations.py"),
    ),
    ("_lib.py", include_str!("../../python/vmpool/_lib.py")),
    (
        "_version.py",
        include_str!("../../python/vmpool/_version.py"),
    ),
    ("nccl.py", include_str!("../../python/vmpool/nccl.py")),
    ("torch.py", include_str!("../../python/vmpool/torch.py")),
];

const SCRIPT: &str = r#"
import vmpool_torch as v
assert v.backend() == "host", v.backend()
lib = v.library()
p = lib.vmpool_alloc(3 << 20, 0, None)
assert p and p % 256 == 0
s = v.stats(0)
assert s["used_bytes"] == 3 << 20 and s["reserved_bytes"] >= 3 << 20, s
text = v.summary(0)
assert text.startswith("vmpool on device 0 (host backend)") and "used        3.0 MiB" in text, text
lib.vmpool_free(p + 256, 3 << 20, 0, None)   # an interior pointer: refused
assert v.stats(0)["refused_frees"] == 1
lib.vmpool_free(p, 3 << 20, 0, None)
lib.vmpool_empty_cache()
assert v.stats(0)["reserved_bytes"] == 0, v.stats(0)
v.empty_cache(0)
s = v.stats(0)
assert (s["used_bytes"], s["reserved_bytes"], s["pending_bytes"]) == (0, 0, 0), s
v.reset_peaks(0)
assert v.stats(0)["reserved_high"] == 0
lib.vmpool_begin_allocate_to_pool(0, v.MempoolId(0, 5), None)
assert v.stats(0)["graph_pools"] == 1
lib.vmpool_end_allocate_to_pool(0, v.MempoolId(0, 5))
lib.vmpool_release_pool(0, v.MempoolId(0, 5))
assert v.stats(0)["graph_pools"] == 0
try:
    v.stats(3)
    raise AssertionError("device 3 does not exist")
except RuntimeError:
    pass
print("ok")
"#;

#[test]
fn ctypes_helper_on_the_host_backend() {
    let record = std::env::temp_dir().join(format!("vmpool-python-{}", std::process::id()));
    // The helper is carried in the binary and written out for Python to
    // import, so that the test needs no source tree.
    let scripts = std::env::temp_dir().join(format!("vmpool-python-lib-{}", std::process::id()));
    std::fs::create_dir_all(&scripts).unwrap();
    std::fs::write(scripts.join("vmpool_torch.py"), HELPER).unwrap();
    std::fs::create_dir_all(scripts.join("vmpool")).unwrap();
    for (name, text) in PACKAGE {
        std::fs::write(scripts.join("vmpool").join(name), text).unwrap();
    }
    let out = Command::new("python3")
        .arg("-c")
        .arg(SCRIPT)
        .env("PYTHONPATH", &scripts)
        .env("VMPOOL_LIB", library())
        .env("VMPOOL_BACKEND", "host")
        .env("VMPOOL_RECORD", &record)
        .output()
        .expect("python3 runs (CI machines have it)");
    std::fs::remove_dir_all(&scripts).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "python failed:\n{stderr}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
    assert!(stderr.contains("points inside the allocation"), "{stderr}");
    // The pool is never dropped; its trace was written out at exit.
    let path = format!("{}.1.trace", record.display());
    let trace = std::fs::read_to_string(&path).expect("the pool recorded its trace");
    // Every pool records, the graph pool the script opened too: none stays.
    let prefix = format!("{}.", record.file_name().unwrap().to_string_lossy());
    for entry in std::fs::read_dir(std::env::temp_dir()).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name().to_string_lossy().starts_with(&prefix) {
            std::fs::remove_file(entry.path()).unwrap();
        }
    }
    let ops: Vec<&str> = trace.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(ops, ["a 1 3145728 1", "f 1 1"], "{trace}");
}
