//! Sharing a pool with another process (`cudaMemPoolExportToShareableHandle`
//! and friends). This program is both processes: the exporter starts itself
//! again as the importer, sends it the pool's handle over a Unix socket
//! (`SCM_RIGHTS`) and the export data of one allocation; each writes and
//! sees the other's write. The exporter frees the allocation while the
//! importer still maps it: the free waits for the importer to let go.
//!
//!     cargo run --release --example ipc [-- --backend host|cuda]

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use anyhow::{ensure, Context as _, Result};
use clap::Parser;
use vmpool::ipc::{recv_handle, send_handle, ExportData, ImportedPool};
use vmpool::vmm::testing::TestBackend;
use vmpool::vmm::{DeviceId, DevicePtr};
use vmpool::{Context, HandleType, PoolAttribute, PoolProps};

mod common;

const DEV: DeviceId = DeviceId(0);
const SIZE: u64 = 32 << 20;

#[derive(Parser)]
struct Args {
    #[arg(long, value_enum, default_value = "auto")]
    backend: common::Which,
    /// Run as the importing process, connecting to this socket.
    #[arg(long, hide = true)]
    importer: Option<PathBuf>,
}

fn word_at<B: TestBackend>(b: &B, s: &B::Stream, at: DevicePtr) -> Result<u32> {
    let mut word = [0u8; 4];
    b.copy_to_host(s, at, &mut word)?;
    Ok(u32::from_ne_bytes(word))
}

fn exporter<B: TestBackend>(b: Arc<B>, backend: &str) -> Result<()> {
    let ctx = Context::new(Arc::clone(&b))?;
    let pool = ctx.create_pool(&PoolProps {
        handle_type: HandleType::PosixFileDescriptor,
        ..PoolProps::new(DEV)
    })?;
    let s = b.create_stream(DEV)?;
    let a = pool.allocate(SIZE)?;
    b.fill_u32(&s, a.ptr(), (SIZE / 4) as usize, 0x1234)?;
    b.synchronize_stream(&s)?;

    let path = std::env::temp_dir().join(format!("vmpool-ipc-example-{}.sock", std::process::id()));
    let listener = UnixListener::bind(&path)?;
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--backend", backend, "--importer"])
        .arg(&path)
        .spawn()?;
    let (mut socket, _) = listener.accept()?;
    std::fs::remove_file(&path)?;
    send_handle(&socket, pool.export_to_shareable_handle()?.as_fd())?;
    socket.write_all(&pool.export_pointer(&a)?.to_bytes())?;
    println!(
        "exporter: sent the pool handle and {} MiB at {}",
        SIZE >> 20,
        a.ptr()
    );

    let mut lines = BufReader::new(socket.try_clone()?).lines();
    let said = lines.next().context("the importer hung up")??;
    println!("importer: {said}");
    let seen = word_at(&*b, &s, a.ptr())?;
    println!("exporter: reads {seen:#x}");
    ensure!(seen == 0xABCD, "the importer's write is not visible");

    pool.free(a)?;
    println!(
        "exporter: freed it while imported: {} lease(s), {} MiB still in use",
        pool.leases(),
        pool.attribute(PoolAttribute::UsedMemCurrent) >> 20
    );
    writeln!(socket, "bye")?;
    ensure!(child.wait()?.success(), "the importer failed");
    println!(
        "exporter: importer gone: {} lease(s), {} MiB in use",
        pool.leases(),
        pool.attribute(PoolAttribute::UsedMemCurrent) >> 20
    );
    Ok(())
}

fn importer<B: TestBackend>(b: Arc<B>, path: PathBuf) -> Result<()> {
    let mut socket = UnixStream::connect(path)?;
    let pool = ImportedPool::from_shareable_handle(&b, recv_handle(&socket)?)?;
    let mut data = [0u8; ExportData::LEN];
    socket.read_exact(&mut data)?;
    let a = pool.import_pointer(&ExportData::from_bytes(&data)?)?;
    let s = b.create_stream(pool.device())?;
    let seen = word_at(&*b, &s, a.ptr())?;
    b.fill_u32(&s, a.ptr(), (a.size() / 4) as usize, 0xABCD)?;
    b.synchronize_stream(&s)?;
    writeln!(
        socket,
        "mapped {} MiB at {}, read {seen:#x}, wrote 0xabcd",
        a.size() >> 20,
        a.ptr()
    )?;
    let mut bye = String::new();
    BufReader::new(&socket).read_line(&mut bye)?;
    drop(a);
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    common::init_tracing();
    let host = || vmpool::vmm::host::Host::new(vmpool::vmm::host::HostConfig::default());
    // The importer is told the backend the exporter ended up with.
    match (common::open(args.backend)?, args.importer) {
        (Some(cuda), None) => exporter(cuda, "cuda"),
        (None, None) => exporter(host()?, "host"),
        (Some(cuda), Some(path)) => importer(cuda, path),
        (None, Some(path)) => importer(host()?, path),
    }
}
