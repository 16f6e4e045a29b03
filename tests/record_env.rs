//! `VMPOOL_RECORD` makes every pool record, with no code change. In a test
//! binary of its own: the variable applies to the whole process.

use vmpool::trace::Trace;
use vmpool::vmm::host::{Host, HostConfig};
use vmpool::vmm::DeviceId;
use vmpool::Context;

#[test]
fn the_environment_variable_turns_recording_on() {
    let prefix = std::env::temp_dir().join(format!("vmpool-env-{}", std::process::id()));
    // The only test in this binary: no other thread reads the environment.
    std::env::set_var("VMPOOL_RECORD", &prefix);
    let ctx = Context::new(Host::new(HostConfig::default()).unwrap()).unwrap();
    let pool = ctx.default_pool(DeviceId(0)).unwrap();
    let a = pool.allocate(4096).unwrap();
    pool.free(a).unwrap();
    drop(pool);
    drop(ctx);
    let dir = prefix.parent().unwrap();
    let name = prefix.file_name().unwrap().to_string_lossy().to_string();
    let files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(&name))
        .collect();
    assert_eq!(files.len(), 1, "one trace per pool: {files:?}");
    let trace = Trace::read(std::fs::File::open(&files[0]).unwrap()).unwrap();
    std::fs::remove_file(&files[0]).unwrap();
    assert_eq!(trace.ops.len(), 2);
    assert_eq!(trace.peak_live, 4096);
}
