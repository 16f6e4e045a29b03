//! `Buffer<T>`: allocated in stream order, freed on its stream when dropped.

use std::sync::Arc;

use vmpool::vmm::host::{Host, HostConfig};
use vmpool::vmm::DeviceId;
use vmpool::{Buffer, Context, Error};

fn context() -> Context<Host> {
    Context::new(Host::new(HostConfig::default()).expect("host backend")).expect("context")
}

#[test]
fn buffer_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Buffer<f32, Host>>();
    assert_send_sync::<Buffer<u64, Host>>();
}

#[test]
fn drop_frees_on_its_stream() {
    let ctx = context();
    let s = ctx.create_stream(DeviceId(0)).unwrap();
    let pool = ctx.default_pool(DeviceId(0)).unwrap();
    let b: Buffer<f32, Host> = ctx.alloc_buffer(1000, &s).unwrap();
    assert_eq!(b.len(), 1000);
    assert_eq!(b.num_bytes(), 4000);
    assert!(!b.is_empty());
    assert_eq!(b.ptr().0 % 256, 0);
    assert_eq!(b.stream(), &s);
    assert_eq!(b.device(), DeviceId(0));
    assert_eq!(pool.stats().used_bytes, 4096);
    let ptr = b.ptr();
    drop(b);
    let stats = pool.stats();
    assert_eq!(stats.used_bytes, 0);
    assert_eq!(stats.frees, 1);
    // Freed on `s`: the same stream reuses it at once.
    let again: Buffer<f32, Host> = Buffer::alloc(&pool, 1000, &s).unwrap();
    assert_eq!(again.ptr(), ptr);
    assert_eq!(pool.stats().same_stream_reuses, 1);
    again.free().unwrap();
    ctx.synchronize_stream(&s).unwrap();
    pool.audit().unwrap();
}

#[test]
fn dropped_on_another_thread() {
    let ctx = context();
    let s = ctx.create_stream(DeviceId(0)).unwrap();
    let pool = ctx.default_pool(DeviceId(0)).unwrap();
    let b: Arc<Buffer<u8, Host>> = Arc::new(ctx.alloc_buffer(1 << 20, &s).unwrap());
    let other = Arc::clone(&b);
    std::thread::spawn(move || drop(other)).join().unwrap();
    drop(b);
    assert_eq!(pool.stats().used_bytes, 0);
}

#[test]
fn into_allocation_hands_over_the_free() {
    let ctx = context();
    let s = ctx.create_stream(DeviceId(0)).unwrap();
    let pool = ctx.default_pool(DeviceId(0)).unwrap();
    let b: Buffer<u32, Host> = ctx.alloc_buffer(64, &s).unwrap();
    let a = b.into_allocation();
    assert_eq!(pool.stats().used_bytes, 256);
    pool.free_async(a, &s).unwrap();
    assert_eq!(pool.stats().used_bytes, 0);
}

#[test]
fn empty_and_zero_sized_buffers_are_refused() {
    let ctx = context();
    let s = ctx.create_stream(DeviceId(0)).unwrap();
    assert!(matches!(
        ctx.alloc_buffer::<f32>(0, &s),
        Err(Error::InvalidSize { .. })
    ));
    assert!(matches!(
        ctx.alloc_buffer::<()>(10, &s),
        Err(Error::InvalidSize { .. })
    ));
    assert!(matches!(
        ctx.alloc_buffer::<u64>(usize::MAX, &s),
        Err(Error::InvalidSize { .. })
    ));
}
