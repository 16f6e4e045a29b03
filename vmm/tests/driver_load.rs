//! Opening the CUDA backend never panics: on a machine without the driver
//! library (CI) it is a `DriverUnavailable` error naming what was tried.

// The package is `vmpool-driver`; the workspace knows it as `vmm`.
extern crate vmpool_driver as vmm;

use vmm::cuda::Cuda;
use vmm::ErrorKind;

#[test]
fn cuda_new_is_an_error_or_a_backend() {
    match Cuda::new() {
        Ok(_) => {}
        Err(err) => {
            assert_eq!(err.kind(), ErrorKind::DriverUnavailable, "{err}");
            assert_eq!(err.call(), "Cuda::new", "{err}");
        }
    }
    // A second attempt gives the same answer without loading again.
    if let Err(err) = Cuda::new() {
        assert_eq!(err.kind(), ErrorKind::DriverUnavailable, "{err}");
        println!("{err}");
    }
}
