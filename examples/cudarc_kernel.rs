//! A cudarc kernel on vmpool memory: `y = a * x + y` over a million floats,
//! with `x` and `y` vmpool `Buffer`s on a stream adopted from cudarc, filled
//! and read back with cudarc's copies, and the result checked. Then the
//! other direction: a stream vmpool made, handed to cudarc by its handle.
//!
//! Needs a CUDA GPU; without one it says so and exits. Run with
//! `cargo run --release --example cudarc_kernel --features cudarc`.

use std::process::ExitCode;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use vmpool::vmm::cuda::Cuda;
use vmpool::vmm::DeviceId;
use vmpool::{Buffer, Context};

/// `vmpool_axpy(float *y, const float *x, float a, unsigned n)`: one thread
/// per value. PTX, so that no NVRTC library is needed at run time and the
/// driver compiles it for whatever GPU it meets.
const AXPY_PTX: &str = "
.version 7.0
.target sm_70
.address_size 64

.visible .entry vmpool_axpy(
    .param .u64 y_param,
    .param .u64 x_param,
    .param .f32 a_param,
    .param .u32 n_param
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .f32 %f<5>;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [y_param];
    ld.param.u64 %rd2, [x_param];
    ld.param.f32 %f1, [a_param];
    ld.param.u32 %r1, [n_param];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd3, %rd1;
    cvta.to.global.u64 %rd4, %rd2;
    mul.wide.u32 %rd5, %r5, 4;
    add.s64 %rd6, %rd4, %rd5;
    add.s64 %rd7, %rd3, %rd5;
    ld.global.f32 %f2, [%rd6];
    ld.global.f32 %f3, [%rd7];
    fma.rn.f32 %f4, %f1, %f2, %f3;
    st.global.f32 [%rd7], %f4;
DONE:
    ret;
}
";

const N: u32 = 1 << 20;

fn main() -> anyhow::Result<ExitCode> {
    // vmpool's driver layer first: cudarc's own loader panics without a
    // driver, vmpool's says why.
    let cuda = match Cuda::new() {
        Ok(cuda) => cuda,
        Err(err) => {
            eprintln!("cudarc_kernel runs on a CUDA GPU only, and none could be opened: {err}");
            return Ok(ExitCode::SUCCESS);
        }
    };
    let ctx = Context::new(cuda)?;
    let cu = CudaContext::new(0)?;
    let cu_stream = cu.new_stream()?;
    let stream = ctx.adopt_cudarc_stream(&cu_stream)?;

    let xs: Vec<f32> = (0..N).map(|i| i as f32).collect();
    let ys: Vec<f32> = (0..N).map(|i| (i % 7) as f32).collect();
    let a = 2.5f32;
    let mut x: Buffer<f32, Cuda> = ctx.alloc_buffer(N as usize, &stream)?;
    let mut y: Buffer<f32, Cuda> = ctx.alloc_buffer(N as usize, &stream)?;
    println!("x at {}, y at {}: vmpool memory", x.ptr(), y.ptr());
    cu_stream.memcpy_htod(&xs, &mut x)?;
    cu_stream.memcpy_htod(&ys, &mut y)?;

    let module = cu.load_module(Ptx::from_src(AXPY_PTX))?;
    let axpy = module.load_function("vmpool_axpy")?;
    let mut launch = cu_stream.launch_builder(&axpy);
    launch.arg(&mut y).arg(&x).arg(&a).arg(&N);
    // SAFETY: the arguments match the kernel's parameters in number, order
    // and type (two device pointers, a float, an unsigned int), and the
    // kernel touches only the N values of each buffer, which stay allocated
    // until work queued before their free on this stream has run.
    unsafe { launch.launch(LaunchConfig::for_num_elems(N)) }?;
    let out = cu_stream.clone_dtoh(&y)?;
    let wrong = (0..N as usize)
        .filter(|&i| out[i] != a * xs[i] + ys[i])
        .count();
    println!("axpy on {N} values: {wrong} wrong");

    // The other direction: a stream vmpool made, wrapped for cudarc.
    let own = ctx.create_stream(DeviceId(0))?;
    // SAFETY: the handle is a live stream of device 0's primary context,
    // cudarc's context here, and `own` outlives `wrapped`.
    let wrapped = unsafe { cu.wrap_borrowed_stream(own.raw().handle() as _) };
    let z = ctx.alloc_buffer::<f32>(N as usize, &own)?;
    wrapped.synchronize()?;
    println!("vmpool stream {:#x} wrapped for cudarc", own.raw().handle());
    drop((x, y, z));
    ctx.synchronize_stream(&stream)?;
    ctx.synchronize_stream(&own)?;
    drop(wrapped);

    let pool = ctx.default_pool(DeviceId(0))?;
    let stats = pool.stats();
    println!(
        "pool: {} allocations, {} frees, {} bytes used after the drops",
        stats.allocations, stats.frees, stats.used_bytes
    );
    if wrong != 0 || stats.used_bytes != 0 {
        eprintln!("FAILED");
        return Ok(ExitCode::FAILURE);
    }
    println!("ok");
    Ok(ExitCode::SUCCESS)
}
