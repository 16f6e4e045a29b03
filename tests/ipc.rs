//! Sharing a pool with another process. The two-process cases run on the
//! host backend always and on CUDA with `--features gpu-tests` (one GPU is
//! enough): the importing process is this test binary run again, with
//! `VMPOOL_IPC_CHILD` set, running only `importer_process`, which obeys
//! one-line commands from the test over a Unix socket; the pool handle
//! travels over the same socket (`SCM_RIGHTS`). In an ordinary run
//! `importer_process` does nothing.
//!
//! Host-only cases import into a second host backend in the same process
//! (a backend has its own tables, as another process would), which is
//! enough for bad input and fault injection.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmpool::ipc::{recv_handle, send_handle, ExportData, ImportedAllocation, ImportedPool};
use vmpool::vmm::host::{Census, Host, HostConfig};
use vmpool::vmm::testing::faulty::{Call, Faulty};
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{Backend, DeviceId};
use vmpool::{Allocation, Context, Error, HandleType, Pool, PoolAttribute, PoolProps};

#[allow(dead_code)]
mod common;

const DEV: DeviceId = DeviceId(0);
const CHILD_ENV: &str = "VMPOOL_IPC_CHILD";
const BACKEND_ENV: &str = "VMPOOL_IPC_BACKEND";

fn shareable_pool<B: TestBackend>(ctx: &Context<B>, device: DeviceId) -> Pool<B> {
    let g = ctx.backend().granularity(device).unwrap() as u64;
    ctx.create_pool(&PoolProps {
        chunk_size: Some(g),
        va_size: Some(4 << 30),
        handle_type: HandleType::PosixFileDescriptor,
        ..PoolProps::new(device)
    })
    .unwrap()
}

fn words<B: TestBackend>(b: &B, s: &B::Stream, ptr: vmpool::vmm::DevicePtr, size: u64) -> Vec<u32> {
    let mut bytes = vec![0u8; size as usize];
    b.copy_to_host(s, ptr, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|w| u32::from_ne_bytes(w.try_into().unwrap()))
        .collect()
}

/// `"ok <v>"` when every word of the range is `v`, else `"mixed"`.
fn uniform(words: &[u32]) -> String {
    match words.first() {
        Some(&v) if words.iter().all(|&w| w == v) => format!("ok {v:x}"),
        _ => "mixed".into(),
    }
}

fn hex(data: &ExportData) -> String {
    data.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ---- the importing process ---------------------------------------------------

/// The other process, as the test sees it.
struct Importer {
    process: Child,
    socket: UnixStream,
    replies: BufReader<UnixStream>,
}

impl Importer {
    /// Starts this binary as an importer on `backend` and sends it `handle`.
    fn spawn(backend: &str, handle: OwnedFd) -> Self {
        Self::spawn_with(backend, handle, &[])
    }

    /// [`Importer::spawn`], with more variables in the importer's
    /// environment.
    fn spawn_with(backend: &str, handle: OwnedFd, env: &[(&str, &str)]) -> Self {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "vmpool-ipc-{}-{}.sock",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let mut process = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "importer_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, &path)
            .env(BACKEND_ENV, backend)
            .envs(env.iter().copied())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let socket = loop {
            match listener.accept() {
                Ok((socket, _)) => break socket,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if let Some(status) = process.try_wait().unwrap() {
                        panic!("the importing process exited before connecting: {status}");
                    }
                    assert!(
                        Instant::now() < deadline,
                        "the importing process never connected"
                    );
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        std::fs::remove_file(&path).unwrap();
        socket.set_nonblocking(false).unwrap();
        send_handle(&socket, handle.as_fd()).unwrap();
        // Ours goes: the connection now closes when the importer does.
        drop(handle);
        let replies = BufReader::new(socket.try_clone().unwrap());
        Self {
            process,
            socket,
            replies,
        }
    }

    fn ask(&mut self, command: &str) -> String {
        writeln!(self.socket, "{command}").unwrap();
        let mut line = String::new();
        let n = self.replies.read_line(&mut line).unwrap();
        assert!(n > 0, "the importing process died on {command:?}");
        line.trim_end().to_owned()
    }

    fn import(&mut self, data: &ExportData) -> String {
        self.ask(&format!("import {}", hex(data)))
    }

    /// Ends the process without letting it drop anything, as a crash would.
    fn die(mut self) {
        writeln!(self.socket, "exit").unwrap();
        let status = self.process.wait().unwrap();
        assert!(status.success(), "{status}");
    }

    fn quit(mut self) {
        assert_eq!(self.ask("quit"), "ok");
        let status = self.process.wait().unwrap();
        assert!(status.success(), "{status}");
    }
}

/// The importing process's side: does nothing unless a case started it.
#[test]
fn importer_process() {
    let Some(path) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let socket = UnixStream::connect(path).unwrap();
    match std::env::var(BACKEND_ENV).as_deref() {
        Ok("host") => obey(&common::host(), socket),
        #[cfg(feature = "gpu-tests")]
        Ok("cuda") => obey(&common::cuda(), socket),
        other => panic!("no backend {other:?} in this build"),
    }
}

/// Runs the test's commands: import, read, fill, drop, census, exit, quit.
fn obey<B: TestBackend>(b: &Arc<B>, socket: UnixStream) {
    let handle = recv_handle(&socket).unwrap();
    let pool = ImportedPool::from_shareable_handle(b, handle).unwrap();
    let stream = b.create_stream(pool.device()).unwrap();
    let mut imports: Vec<Option<ImportedAllocation<B>>> = Vec::new();
    let mut out = socket.try_clone().unwrap();
    for line in BufReader::new(socket).lines() {
        let line = line.unwrap();
        let args: Vec<&str> = line.split(' ').collect();
        let index = |i: usize| args[i].parse::<usize>().unwrap();
        let reply = match args[0] {
            "import" => {
                let data = ExportData::from_bytes(&unhex(args[1])).unwrap();
                match pool.import_pointer(&data) {
                    Ok(a) => {
                        assert_eq!(a.size(), data.size());
                        imports.push(Some(a));
                        format!("ok {}", imports.len() - 1)
                    }
                    Err(Error::StaleExport { .. }) => "err stale".into(),
                    Err(Error::ForeignExport { .. }) => "err foreign".into(),
                    Err(e) => format!("err {e}"),
                }
            }
            "read" => {
                let a = imports[index(1)].as_ref().unwrap();
                uniform(&words(&**b, &stream, a.ptr(), a.size()))
            }
            "fill" => {
                let a = imports[index(1)].as_ref().unwrap();
                let value = u32::from_str_radix(args[2], 16).unwrap();
                b.fill_u32(&stream, a.ptr(), a.size() as usize / 4, value)
                    .unwrap();
                b.synchronize_stream(&stream).unwrap();
                "ok".into()
            }
            "drop" => {
                imports[index(1)] = None;
                "ok".into()
            }
            "device" => format!("ok {}", pool.device().0),
            "exit" => std::process::exit(0),
            "quit" => {
                imports.clear();
                writeln!(out, "ok").unwrap();
                return;
            }
            other => panic!("unknown command {other}"),
        };
        writeln!(out, "{reply}").unwrap();
    }
}

// ---- two processes -----------------------------------------------------------------

/// Both processes see each other's writes; the exporter's free waits for the
/// importer; stale and foreign export data are refused; an importer that
/// dies gives its leases back.
pub fn two_processes_share_a_pool<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = shareable_pool(&ctx, DEV);
    let g = b.granularity(DEV).unwrap() as u64;
    let s = b.create_stream(DEV).unwrap();
    // `a` starts 1 MiB into a chunk and spans four.
    let x = pool.allocate(1 << 20).unwrap();
    let a = pool.allocate(3 * g).unwrap();
    b.fill_u32(&s, a.ptr(), a.size() as usize / 4, 0xA11CE)
        .unwrap();
    b.synchronize_stream(&s).unwrap();

    let mut child = Importer::spawn(b.name(), pool.export_to_shareable_handle().unwrap());
    let data = pool.export_pointer(&a).unwrap();
    assert_eq!(pool.export_pointer(&a).unwrap(), data, "exports are stable");
    assert_eq!(child.import(&data), "ok 0");
    assert_eq!(pool.leases(), 1);
    assert_eq!(child.ask("read 0"), "ok a11ce");
    assert_eq!(child.ask("fill 0 b0b"), "ok");
    assert_eq!(uniform(&words(&**b, &s, a.ptr(), a.size())), "ok b0b");

    // Freed here while mapped there: neither reused nor moved nor released.
    let a_span = a.ptr().0..a.ptr().0 + a.size();
    pool.free(a).unwrap();
    assert_eq!(pool.leases(), 1);
    let c = pool.allocate(3 * g).unwrap();
    assert!(
        !a_span.contains(&c.ptr().0) && !(c.ptr().0..c.ptr().0 + c.size()).contains(&a_span.start),
        "the leased range was handed out again"
    );
    pool.trim_to(0).unwrap();
    b.fill_u32(&s, c.ptr(), c.size() as usize / 4, 0xC).unwrap();
    b.synchronize_stream(&s).unwrap();
    assert_eq!(child.ask("read 0"), "ok b0b");
    let used = (1 << 20) + 3 * g;
    assert_eq!(pool.attribute(PoolAttribute::UsedMemCurrent), used + 3 * g);
    // Dropped there: the lease ends and the deferred free is carried out.
    assert_eq!(child.ask("drop 0"), "ok");
    assert_eq!(pool.leases(), 0);
    assert_eq!(pool.attribute(PoolAttribute::UsedMemCurrent), used);

    // Stale: freed since it was exported. Foreign: another pool's data.
    assert_eq!(child.import(&data), "err stale");
    let other = shareable_pool(&ctx, DEV);
    let d = other.allocate(1 << 20).unwrap();
    assert_eq!(
        child.import(&other.export_pointer(&d).unwrap()),
        "err foreign"
    );
    assert_eq!(pool.leases() + other.leases(), 0);

    // A stream-ordered free of memory the importer holds, then the importer
    // dies holding it: its leases end, and the free completes in order.
    let stream = ctx.create_stream(DEV).unwrap();
    let e = pool.allocate(2 * g).unwrap();
    let e_data = pool.export_pointer(&e).unwrap();
    assert_eq!(child.import(&e_data), "ok 1");
    pool.free_async(e, &stream).unwrap();
    assert_eq!(pool.leases(), 1);
    child.die();
    wait_for("the dead importer's lease to end", || pool.leases() == 0);
    ctx.synchronize_stream(&stream).unwrap();
    assert_eq!(pool.attribute(PoolAttribute::UsedMemCurrent), used);

    for a in [x, c] {
        pool.free(a).unwrap();
    }
    other.free(d).unwrap();
    for p in [&pool, &other] {
        p.trim_to(0).unwrap();
        assert_eq!(p.attribute(PoolAttribute::ReservedMemCurrent), 0);
        p.audit().unwrap();
    }
}

/// Several allocations of one chunk imported side by side, and an importer
/// that quits cleanly.
pub fn imports_share_chunks<B: TestBackend>(b: &Arc<B>) {
    let ctx = Context::new(Arc::clone(b)).unwrap();
    let pool = shareable_pool(&ctx, DEV);
    let s = b.create_stream(DEV).unwrap();
    let parts: Vec<Allocation> = (0..4).map(|_| pool.allocate(256 << 10).unwrap()).collect();
    assert_eq!(pool.snapshot().units.len(), 1, "all four share one chunk");
    let mut child = Importer::spawn(b.name(), pool.export_to_shareable_handle().unwrap());
    for (i, a) in parts.iter().enumerate() {
        b.fill_u32(&s, a.ptr(), a.size() as usize / 4, i as u32 + 1)
            .unwrap();
        b.synchronize_stream(&s).unwrap();
        assert_eq!(
            child.import(&pool.export_pointer(a).unwrap()),
            format!("ok {i}")
        );
    }
    for i in 0..4 {
        assert_eq!(child.ask(&format!("read {i}")), format!("ok {:x}", i + 1));
        assert_eq!(child.ask(&format!("fill {i} {:x}", 0x10 * (i + 1))), "ok");
    }
    for (i, a) in parts.iter().enumerate() {
        assert_eq!(
            uniform(&words(&**b, &s, a.ptr(), a.size())),
            format!("ok {:x}", 0x10 * (i + 1))
        );
    }
    assert_eq!(pool.leases(), 4);
    child.quit();
    assert_eq!(pool.leases(), 0);
    for a in parts {
        pool.free(a).unwrap();
    }
    pool.trim_to(0).unwrap();
    pool.audit().unwrap();
}

macro_rules! suite {
    ($backend:ident, $open:path, $after:expr) => {
        mod $backend {
            #[test]
            fn two_processes_share_a_pool() {
                let b = $open();
                super::two_processes_share_a_pool(&b);
                $after(&b);
            }
            #[test]
            fn imports_share_chunks() {
                let b = $open();
                super::imports_share_chunks(&b);
                $after(&b);
            }
        }
    };
}

/// Everything the case made is gone from the host backend.
fn nothing_left(b: &Arc<Host>) {
    assert_eq!(b.census(), Census::default());
}

suite!(host, crate::common::host, crate::nothing_left);
#[cfg(feature = "gpu-tests")]
suite!(cuda, crate::common::cuda, |_| ());

/// Two GPUs: an importer that sees only the exporter's device 1 (with
/// `CUDA_VISIBLE_DEVICES=1`), as its device 0, finds it by UUID and reads
/// the exporter's data there.
#[cfg(feature = "gpu-tests")]
#[test]
#[ignore = "needs two GPUs: gpu-run.sh multi runs it"]
fn cuda_importer_that_numbers_devices_otherwise() {
    let b = common::cuda();
    assert!(b.device_count().unwrap() >= 2, "needs two GPUs");
    let ctx = Context::new(Arc::clone(&b)).unwrap();
    let pool = shareable_pool(&ctx, DeviceId(1));
    let a = pool.allocate(3 << 20).unwrap();
    let s = b.create_stream(DeviceId(1)).unwrap();
    b.fill_u32(&s, a.ptr(), (a.size() / 4) as usize, 5).unwrap();
    b.synchronize_stream(&s).unwrap();
    let mut child = Importer::spawn_with(
        "cuda",
        pool.export_to_shareable_handle().unwrap(),
        &[("CUDA_VISIBLE_DEVICES", "1")],
    );
    assert_eq!(child.ask("device"), "ok 0");
    assert_eq!(child.import(&pool.export_pointer(&a).unwrap()), "ok 0");
    assert_eq!(child.ask("read 0"), "ok 5");
    child.quit();
    pool.free(a).unwrap();
}

// ---- host only: one process, two backends ---------------------------------------

fn host(devices: u32) -> Arc<Host> {
    Host::new(HostConfig {
        devices,
        first_device: 0,
        memory_per_device: 1 << 30,
        granularity: 2 << 20,
    })
    .unwrap()
}

#[test]
fn bad_input_is_refused() {
    let exporter = host(2);
    let ctx = Context::new(Arc::clone(&exporter)).unwrap();
    let plain = ctx.create_pool(&PoolProps::new(DEV)).unwrap();
    let a = plain.allocate(4096).unwrap();
    assert!(matches!(
        plain.export_to_shareable_handle(),
        Err(Error::NotShareable)
    ));
    assert!(matches!(plain.export_pointer(&a), Err(Error::NotShareable)));
    let pool = shareable_pool(&ctx, DeviceId(1));
    assert!(matches!(
        pool.export_pointer(&a),
        Err(Error::WrongPool { .. })
    ));
    assert!(matches!(
        ExportData::from_bytes(&[0; 8]),
        Err(Error::Ipc(_))
    ));

    // Not a pool handle at all.
    let importer = host(2);
    let file: OwnedFd = std::fs::File::open("/dev/null").unwrap().into();
    assert!(matches!(
        ImportedPool::from_shareable_handle(&importer, file),
        Err(Error::Ipc(_))
    ));
    // A pool on device 1, imported where only the machine's device 0 is
    // seen.
    let small = host(1);
    assert!(matches!(
        ImportedPool::from_shareable_handle(&small, pool.export_to_shareable_handle().unwrap()),
        Err(Error::DeviceNotVisible {
            device: DeviceId(1)
        })
    ));
    // The handle of a pool that has gone.
    let handle = pool.export_to_shareable_handle().unwrap();
    let b = pool.allocate(1 << 20).unwrap();
    let data = pool.export_pointer(&b).unwrap();
    let imported = ImportedPool::from_shareable_handle(&importer, handle).unwrap();
    pool.free(b).unwrap();
    drop(pool);
    assert!(matches!(imported.import_pointer(&data), Err(Error::Ipc(_))));
    plain.free(a).unwrap();
    drop((plain, ctx, imported));
    assert_eq!(exporter.census(), Census::default());
    assert_eq!(importer.census(), Census::default());
    assert_eq!(small.census(), Census::default());
}

/// The importer numbers devices from the machine's device 1 on (as
/// `CUDA_VISIBLE_DEVICES=1` would): the exporter's device 1 is its device
/// 0, found by UUID, and the imported memory is mapped and read there.
#[test]
fn devices_are_matched_by_uuid_not_ordinal() {
    let exporter = host(2);
    let ctx = Context::new(Arc::clone(&exporter)).unwrap();
    let pool = shareable_pool(&ctx, DeviceId(1));
    let a = pool.allocate(3 << 20).unwrap();
    let s = exporter.create_stream(DeviceId(1)).unwrap();
    exporter
        .fill_u32(&s, a.ptr(), (a.size() / 4) as usize, 5)
        .unwrap();
    exporter.synchronize_stream(&s).unwrap();
    let importer = Host::new(HostConfig {
        devices: 1,
        first_device: 1,
        memory_per_device: 1 << 30,
        granularity: 2 << 20,
    })
    .unwrap();
    let imported =
        ImportedPool::from_shareable_handle(&importer, pool.export_to_shareable_handle().unwrap())
            .unwrap();
    assert_eq!(imported.device(), DeviceId(0));
    let m = imported
        .import_pointer(&pool.export_pointer(&a).unwrap())
        .unwrap();
    let t = importer.create_stream(DeviceId(0)).unwrap();
    assert_eq!(uniform(&words(&*importer, &t, m.ptr(), m.size())), "ok 5");
    drop((m, imported, t));
    pool.free(a).unwrap();
    drop((s, pool, ctx));
    assert_eq!(exporter.census(), Census::default());
    assert_eq!(importer.census(), Census::default());
}

/// Imports `a` of `pool` into `importer` (in this process) and checks the
/// data; true if it worked.
fn import_once<E: Backend, I: TestBackend>(
    pool: &Pool<E>,
    a: &Allocation,
    importer: &Arc<I>,
) -> bool {
    let imported = match ImportedPool::from_shareable_handle(
        importer,
        pool.export_to_shareable_handle().unwrap(),
    ) {
        Ok(imported) => imported,
        Err(Error::Driver(_)) => return false,
        Err(e) => panic!("{e}"),
    };
    let data = pool.export_pointer(a).unwrap();
    let result = imported.import_pointer(&data);
    let ok = match &result {
        Ok(m) => {
            let s = importer.create_stream(DEV).unwrap();
            assert_eq!(uniform(&words(&**importer, &s, m.ptr(), m.size())), "ok 5");
            true
        }
        // A failure on the importer's side, or one the exporter reports.
        Err(Error::Driver(_) | Error::Ipc(_)) => false,
        Err(e) => panic!("{e}"),
    };
    drop(result);
    assert_eq!(pool.leases(), 0, "a failed import kept its lease");
    ok
}

/// Every export and import call, and every call the importer makes to map,
/// fails in turn: the import fails cleanly, no lease is left, and neither
/// side leaks.
#[test]
fn faults_on_either_side_leak_nothing() {
    // The exporter's backend fails.
    let injected = common::at_every_call_site(&[Call::ExportChunk], |b| {
        let ctx = Context::new(Arc::clone(b)).unwrap();
        let pool = shareable_pool(&ctx, DEV);
        let a = pool.allocate(5 << 20).unwrap();
        let s = b.create_stream(DEV).unwrap();
        b.fill_u32(&s, a.ptr(), a.size() as usize / 4, 5).unwrap();
        b.synchronize_stream(&s).unwrap();
        let importer = host(1);
        import_once(&pool, &a, &importer);
        pool.free(a).unwrap();
        assert_eq!(importer.census(), Census::default());
        b.disarm()
    });
    assert!(injected >= 3, "{injected} faults");
    // The importer's backend fails.
    let injected = common::at_every_call_site(
        &[Call::ImportChunk, Call::Reserve, Call::Map, Call::SetAccess],
        |b: &Arc<Faulty<Host>>| {
            let exporter = host(1);
            let ctx = Context::new(Arc::clone(&exporter)).unwrap();
            let pool = shareable_pool(&ctx, DEV);
            let a = pool.allocate(5 << 20).unwrap();
            let s = exporter.create_stream(DEV).unwrap();
            exporter
                .fill_u32(&s, a.ptr(), a.size() as usize / 4, 5)
                .unwrap();
            exporter.synchronize_stream(&s).unwrap();
            import_once(&pool, &a, b);
            pool.free(a).unwrap();
            drop((pool, ctx));
            assert_eq!(exporter.census(), Census::default());
            b.disarm()
        },
    );
    assert!(injected >= 10, "{injected} faults");
}

/// The exporter's pool goes while another process still maps an import of
/// it: the import stays usable (the memory stays, as a live allocation's
/// does when its pool is dropped), and dropping it later is quiet and
/// leaves nothing behind in the importer.
#[test]
fn an_import_outlives_its_pool() {
    let exporter = host(1);
    let ctx = Context::new(Arc::clone(&exporter)).unwrap();
    let pool = shareable_pool(&ctx, DEV);
    let a = pool.allocate(4 << 20).unwrap();
    let s = exporter.create_stream(DEV).unwrap();
    exporter
        .fill_u32(&s, a.ptr(), a.size() as usize / 4, 0x0DD)
        .unwrap();
    exporter.synchronize_stream(&s).unwrap();
    let importer = host(1);
    let imported =
        ImportedPool::from_shareable_handle(&importer, pool.export_to_shareable_handle().unwrap())
            .unwrap();
    let m = imported
        .import_pointer(&pool.export_pointer(&a).unwrap())
        .unwrap();
    pool.free(a).unwrap();
    assert_eq!(pool.leases(), 1);
    drop((pool, ctx));
    let si = importer.create_stream(DEV).unwrap();
    assert_eq!(uniform(&words(&*importer, &si, m.ptr(), m.size())), "ok dd");
    drop((m, imported));
    assert_eq!(importer.census(), Census::default());
}
