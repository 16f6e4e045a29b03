//! The C layer's settings, from the environment (README.md, "PyTorch"):
//! which backend, the pools' chunk sizes and release threshold, timing.

/// A whole number of at least 1 the environment asked for.
fn at_least_one<T: std::str::FromStr + PartialOrd + From<u8>>(
    name: &'static str,
    value: String,
    expected: &'static str,
) -> Result<T, ConfigError> {
    match value.trim().parse::<T>() {
        Ok(n) if n >= T::from(1) => Ok(n),
        _ => Err(ConfigError::Other {
            name,
            value,
            expected,
        }),
    }
}

/// Bytes the environment asked for, in the forms the tools' size options
/// take ([`vmpool::parse_bytes`]: `512MiB`, `2G`, `1.5GiB`, `max`).
fn parse_bytes(name: &str, value: &str) -> Result<u64, ConfigError> {
    vmpool::parse_bytes(value).map_err(|_| ConfigError::Bytes {
        name: name.to_owned(),
        value: value.to_owned(),
    })
}

/// The setting `name` as `parse` reads it, `default` when unset; a value
/// `parse` refuses is an error that says what was `expected`.
fn setting<T, E>(
    lookup: &impl Fn(&str) -> Option<String>,
    name: &'static str,
    default: T,
    parse: impl FnOnce(&str) -> Result<T, E>,
    expected: &'static str,
) -> Result<T, ConfigError> {
    match lookup(name) {
        None => Ok(default),
        Some(value) => parse(&value).map_err(|_| ConfigError::Other {
            name,
            value,
            expected,
        }),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{name}={value:?}: expected bytes, such as 1073741824, 512MiB, 2G or max")]
    Bytes { name: String, value: String },
    #[error("{name}={value:?}: expected {expected}")]
    Other {
        name: &'static str,
        value: String,
        expected: &'static str,
    },
}

/// Which driver layer the library runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    Cuda,
    /// The host backend, for tests without a GPU; stream handles are then
    /// opaque keys.
    Host,
}

/// The C layer's growth-chunk divisor unless `VMPOOL_CHUNK_DIVISOR` says
/// otherwise: half the library's ([`vmpool::DEFAULT_CHUNK_DIVISOR`]), so
/// chunks up to twice as large once the pool holds 2 GiB (below that,
/// growth is by granules either way:
/// [`vmpool::DEFAULT_GRANULE_GROWTH_BELOW`]). Under PyTorch each new
/// chunk's driver calls cost step time when the pool grows behind queued
/// work; a 1024th held the footprint of a 2048th on GPT-2, ResNet-50 and a
/// GQA decoder at random shapes, at native's time where a 2048th and the
/// earlier 256th were slower (docs/RESULTS.md, "Growth chunks of a 1024th
/// under PyTorch").
pub const DEFAULT_CHUNK_DIVISOR: u64 = 1024;

/// The library's settings, from the environment (README.md, "PyTorch").
///
/// `repr(C)`: `timing`, which every call reads, first.
#[derive(Debug, Clone, PartialEq, Eq)]
#[repr(C)]
pub struct Config {
    /// `VMPOOL_TIMING`: `1` to time every `vmpool_alloc` and `vmpool_free`
    /// (two clock reads a call) and report the total in the statistics;
    /// default `0`.
    pub timing: bool,
    /// `VMPOOL_BACKEND`: `cuda` (default) or `host`.
    pub backend: BackendChoice,
    /// `VMPOOL_RELEASE_THRESHOLD`: bytes each pool keeps across
    /// `vmpool_synchronize`; default `max` (keep everything, as PyTorch's
    /// own allocator does).
    pub release_threshold: u64,
    /// `VMPOOL_CHUNK_SIZE`: the largest growth chunk; default the pool's.
    pub chunk_size: Option<u64>,
    /// `VMPOOL_CHUNK_DIVISOR`: growth chunks of at most the pool's reserved
    /// bytes over this (`PoolProps::chunk_divisor`); default
    /// [`DEFAULT_CHUNK_DIVISOR`]; `off`: every growth by whole
    /// `VMPOOL_CHUNK_SIZE` chunks.
    pub chunk_divisor: Option<u64>,
    /// `VMPOOL_GRANULE_GROWTH_BELOW`: with a divisor, growth by granules
    /// while the pool holds fewer bytes than this, and up to 16 GiB until
    /// the second step mark (`PoolProps::granule_growth_below`); default
    /// [`vmpool::DEFAULT_GRANULE_GROWTH_BELOW`]; 0: the divisor alone.
    pub granule_growth_below: u64,
    /// `VMPOOL_VA_SIZE`: the address space each device's pool reserves
    /// (`PoolProps::va_size`); default four times the device's memory.
    pub va_size: Option<u64>,
    /// `VMPOOL_FRESH_START`: `never` to keep the layout the last work left
    /// when the program empties a pool (`PoolProps::fresh_start`); default
    /// `when-emptied`.
    pub fresh_start: vmpool::FreshStart,
    /// `VMPOOL_HANDLE_TYPE`: `posix_fd` to create every pool's chunks
    /// exportable, so that NCCL can register the memory (Note [NCCL
    /// registration] in docs/DESIGN.md); default `none`.
    pub handle_type: vmpool::HandleType,
    /// `VMPOOL_HOST_DEVICES` and `VMPOOL_HOST_MEMORY` (per device): the host
    /// backend's devices; default 1 of 4 GiB.
    pub host_devices: u32,
    pub host_memory: u64,
    /// `VMPOOL_LOG`: the log filter (`tracing_subscriber::EnvFilter`
    /// directives, such as `info` or `vmpool=debug`); default `warn`.
    pub log: String,
}

impl Config {
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// The settings from `lookup(name)`, for tests without touching the
    /// process environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let bytes =
            |name: &str, default: u64| lookup(name).map_or(Ok(default), |v| parse_bytes(name, &v));
        let backend = setting(
            &lookup,
            "VMPOOL_BACKEND",
            BackendChoice::Cuda,
            |v| match v {
                "cuda" => Ok(BackendChoice::Cuda),
                "host" => Ok(BackendChoice::Host),
                _ => Err(()),
            },
            "cuda or host",
        )?;
        let host_devices = lookup("VMPOOL_HOST_DEVICES")
            .map(|v| at_least_one("VMPOOL_HOST_DEVICES", v, "a number of devices, at least 1"))
            .transpose()?
            .unwrap_or(1);
        let timing = setting(
            &lookup,
            "VMPOOL_TIMING",
            false,
            |v| match v.trim() {
                "0" => Ok(false),
                "1" => Ok(true),
                _ => Err(()),
            },
            "0 or 1",
        )?;
        let chunk_size = match lookup("VMPOOL_CHUNK_SIZE") {
            None => None,
            Some(v) => Some(parse_bytes("VMPOOL_CHUNK_SIZE", &v)?),
        };
        let chunk_divisor = setting(
            &lookup,
            "VMPOOL_CHUNK_DIVISOR",
            Some(DEFAULT_CHUNK_DIVISOR),
            vmpool::parse_chunk_divisor,
            "a whole number, at least 1, or off",
        )?;
        let va_size = match lookup("VMPOOL_VA_SIZE") {
            None => None,
            Some(v) => match parse_bytes("VMPOOL_VA_SIZE", &v)? {
                0 => {
                    return Err(ConfigError::Other {
                        name: "VMPOOL_VA_SIZE",
                        value: v,
                        expected: "bytes, more than 0, such as 2T",
                    })
                }
                bytes => Some(bytes),
            },
        };
        let fresh_start = setting(
            &lookup,
            "VMPOOL_FRESH_START",
            vmpool::FreshStart::WhenEmptied,
            vmpool::parse_fresh_start,
            "when-emptied or never",
        )?;
        let handle_type = setting(
            &lookup,
            "VMPOOL_HANDLE_TYPE",
            vmpool::HandleType::None,
            vmpool::parse_handle_type,
            "none or posix_fd",
        )?;
        let log = lookup("VMPOOL_LOG").unwrap_or_else(|| "warn".to_owned());
        if tracing_subscriber::EnvFilter::try_new(&log).is_err() {
            return Err(ConfigError::Other {
                name: "VMPOOL_LOG",
                value: log,
                expected: "a log filter, such as warn, info, off or vmpool=debug",
            });
        }
        Ok(Self {
            log,
            backend,
            release_threshold: bytes("VMPOOL_RELEASE_THRESHOLD", u64::MAX)?,
            chunk_size,
            chunk_divisor,
            granule_growth_below: bytes(
                "VMPOOL_GRANULE_GROWTH_BELOW",
                vmpool::DEFAULT_GRANULE_GROWTH_BELOW,
            )?,
            va_size,
            fresh_start,
            handle_type,
            host_devices,
            host_memory: bytes("VMPOOL_HOST_MEMORY", 4 << 30)?,
            timing,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(vars: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::from_lookup(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn defaults() {
        let c = config(&[]).unwrap();
        assert_eq!(c.backend, BackendChoice::Cuda);
        assert_eq!(c.release_threshold, u64::MAX);
        assert_eq!(c.chunk_size, None);
        assert_eq!(c.chunk_divisor, Some(DEFAULT_CHUNK_DIVISOR));
        assert_eq!(c.granule_growth_below, vmpool::DEFAULT_GRANULE_GROWTH_BELOW);
    }

    #[test]
    fn granule_growth_below() {
        let c = config(&[("VMPOOL_GRANULE_GROWTH_BELOW", "512MiB")]).unwrap();
        assert_eq!(c.granule_growth_below, 512 << 20);
        let c = config(&[("VMPOOL_GRANULE_GROWTH_BELOW", "0")]).unwrap();
        assert_eq!(c.granule_growth_below, 0);
        let err = config(&[("VMPOOL_GRANULE_GROWTH_BELOW", "2 GX")]).unwrap_err();
        assert!(
            err.to_string().contains("VMPOOL_GRANULE_GROWTH_BELOW"),
            "{err}"
        );
    }

    #[test]
    fn fresh_start() {
        let c = config(&[]).unwrap();
        assert_eq!(c.fresh_start, vmpool::FreshStart::WhenEmptied);
        let c = config(&[("VMPOOL_FRESH_START", "never")]).unwrap();
        assert_eq!(c.fresh_start, vmpool::FreshStart::Never);
        let err = config(&[("VMPOOL_FRESH_START", "off")]).unwrap_err();
        assert!(err.to_string().contains("VMPOOL_FRESH_START"), "{err}");
    }

    #[test]
    fn chunk_divisor() {
        let c = config(&[("VMPOOL_CHUNK_DIVISOR", " 4096 ")]).unwrap();
        assert_eq!(c.chunk_divisor, Some(4096));
        let c = config(&[("VMPOOL_CHUNK_DIVISOR", "off")]).unwrap();
        assert_eq!(c.chunk_divisor, None);
        for bad in ["", "0", "-1", "1/4096", "x", "none"] {
            let err = config(&[("VMPOOL_CHUNK_DIVISOR", bad)]).unwrap_err();
            assert!(err.to_string().contains("VMPOOL_CHUNK_DIVISOR"), "{err}");
        }
    }

    #[test]
    fn byte_sizes() {
        for (text, bytes) in [
            ("0", 0),
            ("4096", 4096),
            ("2M", 2 << 20),
            ("2MiB", 2 << 20),
            ("1 GiB", 1 << 30),
            ("3g", 3 << 30),
            ("2 GB", 2 << 30),
            ("1.5GiB", 3 << 29),
            ("max", u64::MAX),
            ("MAX", u64::MAX),
        ] {
            let c = config(&[("VMPOOL_RELEASE_THRESHOLD", text)]).unwrap();
            assert_eq!(c.release_threshold, bytes, "{text}");
        }
        for bad in [
            "",
            "-1",
            "1.5.G",
            "12Q",
            "99999999999999999999",
            "20000000T",
        ] {
            let err = config(&[("VMPOOL_CHUNK_SIZE", bad)]).unwrap_err();
            assert!(err.to_string().contains("VMPOOL_CHUNK_SIZE"), "{err}");
        }
    }

    #[test]
    fn va_size() {
        assert_eq!(config(&[]).unwrap().va_size, None);
        let c = config(&[("VMPOOL_VA_SIZE", "2T")]).unwrap();
        assert_eq!(c.va_size, Some(2 << 40));
        for bad in ["0", "", "-1", "lots"] {
            let err = config(&[("VMPOOL_VA_SIZE", bad)]).unwrap_err();
            assert!(err.to_string().contains("VMPOOL_VA_SIZE"), "{err}");
        }
    }

    #[test]
    fn handle_type() {
        assert_eq!(config(&[]).unwrap().handle_type, vmpool::HandleType::None);
        let c = config(&[("VMPOOL_HANDLE_TYPE", "posix_fd")]).unwrap();
        assert_eq!(c.handle_type, vmpool::HandleType::PosixFileDescriptor);
        for bad in ["", "fd", "fabric", "1"] {
            let err = config(&[("VMPOOL_HANDLE_TYPE", bad)]).unwrap_err();
            assert!(err.to_string().contains("VMPOOL_HANDLE_TYPE"), "{err}");
        }
    }

    #[test]
    fn timing_switch() {
        assert!(!config(&[]).unwrap().timing);
        assert!(config(&[("VMPOOL_TIMING", "1")]).unwrap().timing);
        assert!(!config(&[("VMPOOL_TIMING", "0")]).unwrap().timing);
        let err = config(&[("VMPOOL_TIMING", "yes")]).unwrap_err();
        assert!(err.to_string().contains("VMPOOL_TIMING"), "{err}");
    }

    /// The settings table is one: the header's and README's rows are the
    /// same, and name every variable this module reads.
    #[test]
    fn the_header_and_the_readme_have_one_settings_table() {
        let rows = |text: &str| -> Vec<String> {
            text.lines()
                .map(|l| l.trim_start_matches(" * "))
                .filter(|l| l.starts_with("| `VMPOOL_"))
                .map(str::to_owned)
                .collect()
        };
        let header = rows(include_str!("../include/vmpool.h"));
        assert_eq!(header, rows(include_str!("../../README.md")));
        let source = include_str!("config.rs");
        let mut read: Vec<&str> = source
            .split('"')
            .filter(|w| {
                w.len() > 7
                    && w.starts_with("VMPOOL_")
                    && w[7..].chars().all(|c| c.is_ascii_uppercase() || c == '_')
            })
            .collect();
        read.extend(["VMPOOL_RECORD", "VMPOOL_LIB", "VMPOOL_MARK_STEPS"]);
        read.sort();
        read.dedup();
        for name in read {
            let row = format!("| `{name}` |");
            assert!(
                header.iter().any(|r| r.starts_with(&row)),
                "{name} is not in the table"
            );
        }
    }

    #[test]
    fn log_filter() {
        assert_eq!(config(&[]).unwrap().log, "warn");
        for good in ["off", "info", "vmpool=debug,warn"] {
            assert_eq!(config(&[("VMPOOL_LOG", good)]).unwrap().log, good);
        }
        for bad in ["vmpool=loud", "=", "warn,vmpool[x=1"] {
            let err = config(&[("VMPOOL_LOG", bad)]).unwrap_err();
            assert!(err.to_string().contains("VMPOOL_LOG"), "{err}");
        }
    }

    #[test]
    fn bad_backend_and_devices() {
        assert!(config(&[("VMPOOL_BACKEND", "gpu")]).is_err());
        assert!(config(&[("VMPOOL_HOST_DEVICES", "0")]).is_err());
        let c = config(&[("VMPOOL_BACKEND", "host"), ("VMPOOL_HOST_DEVICES", "2")]).unwrap();
        assert_eq!((c.backend, c.host_devices), (BackendChoice::Host, 2));
    }
}
