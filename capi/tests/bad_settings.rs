//! A bad setting stops the library, and says why on stderr even when
//! `VMPOOL_LOG` turns logging off or is itself the bad setting. The library
//! is loaded by a separate process (Python's ctypes), whose stderr is read.

use std::path::PathBuf;
use std::process::Command;

/// The library `cargo test` built beside this test, in target/<profile>/deps.
fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().join("libvmpool_c.so");
    assert!(lib.is_file(), "{} was not built", lib.display());
    lib
}

const SCRIPT: &str = r#"
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.vmpool_alloc.restype = ctypes.c_void_p
lib.vmpool_backend.restype = ctypes.c_char_p
assert lib.vmpool_alloc(ctypes.c_ssize_t(4096), 0, None) is None
print(lib.vmpool_backend().decode())
"#;

/// Runs the script with `vars` on the host backend: its stdout and stderr.
fn run(vars: &[(&str, &str)]) -> (String, String) {
    let out = Command::new("python3")
        .args(["-c", SCRIPT])
        .arg(library())
        .env("VMPOOL_BACKEND", "host")
        .envs(vars.iter().copied())
        .output()
        .expect("python3 runs (CI machines have it)");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "python failed:\n{stderr}");
    (
        String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        stderr,
    )
}

#[test]
fn a_bad_setting_is_said_on_stderr_whatever_the_log_filter() {
    for (vars, named) in [
        (
            &[("VMPOOL_LOG", "off"), ("VMPOOL_CHUNK_SIZE", "12Q")][..],
            "VMPOOL_CHUNK_SIZE",
        ),
        (&[("VMPOOL_LOG", "vmpool=loud")][..], "VMPOOL_LOG"),
        (&[("VMPOOL_HOST_MEMORY", "lots")][..], "VMPOOL_HOST_MEMORY"),
    ] {
        let (backend, stderr) = run(vars);
        assert_eq!(backend, "none", "{vars:?}");
        let lines: Vec<&str> = stderr
            .lines()
            .filter(|l| l.contains("cannot start"))
            .collect();
        assert_eq!(lines.len(), 1, "{vars:?}: {stderr}");
        assert!(
            lines[0].starts_with("vmpool: cannot start: ") && lines[0].contains(named),
            "{vars:?}: {stderr}"
        );
    }
}
