//! The back-ends a search runs on. Each is one arm of [`Backend`]; every property of a back-end
//! (its source language and dialect, its vendor, whether the Python MLX worker serves it) is a
//! `match` over all arms, so a new back-end is one arm the compiler walks through. The spelling
//! (`cpu`, `cuda`, `mlx-cuda`, `mlx-metal`) is the one of `task.toml`, the worker protocol
//! and the store.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

use crate::protocol::Lang;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// C++ through the system compiler, run in the sandboxed runner.
    Cpu,
    /// CUDA C++ through NVRTC and the CUDA driver.
    Cuda,
    /// A kernel body inside MLX, CUDA dialect, on MLX's CUDA back-end (the Python worker).
    MlxCuda,
    /// A kernel body inside MLX, Metal dialect, on Apple silicon (the Python worker).
    MlxMetal,
}

/// The language family a kernel body is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    Cpp,
    Cuda,
    Metal,
}

/// Whose hardware runs the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vendor {
    /// The host's CPU.
    Host,
    Nvidia,
    Apple,
}

impl Backend {
    pub const ALL: [Backend; 4] = [Backend::Cpu, Backend::Cuda, Backend::MlxCuda, Backend::MlxMetal];

    /// The spelling of `task.toml`, the protocol and the store.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::MlxCuda => "mlx-cuda",
            Backend::MlxMetal => "mlx-metal",
        }
    }

    /// The language of a candidate on this back-end.
    pub fn lang(self) -> Lang {
        match self {
            Backend::Cpu => Lang::Cpp,
            Backend::Cuda => Lang::Cuda,
            Backend::MlxCuda => Lang::MlxCuda,
            Backend::MlxMetal => Lang::MlxMetal,
        }
    }

    pub fn dialect(self) -> Dialect {
        match self {
            Backend::Cpu => Dialect::Cpp,
            Backend::Cuda | Backend::MlxCuda => Dialect::Cuda,
            Backend::MlxMetal => Dialect::Metal,
        }
    }

    pub fn vendor(self) -> Vendor {
        match self {
            Backend::Cpu => Vendor::Host,
            Backend::Cuda | Backend::MlxCuda => Vendor::Nvidia,
            Backend::MlxMetal => Vendor::Apple,
        }
    }

    /// Served by the Python MLX worker (`python/ksearch_mlx`), not by `ksearch worker`.
    pub fn is_mlx(self) -> bool {
        match self {
            Backend::Cpu | Backend::Cuda => false,
            Backend::MlxCuda | Backend::MlxMetal => true,
        }
    }

    /// Runs on a GPU (a worker per device, device numbers on its command line).
    pub fn is_gpu(self) -> bool {
        match self.vendor() {
            Vendor::Host => false,
            Vendor::Nvidia | Vendor::Apple => true,
        }
    }

    /// What a requested back-end means here: `auto` is `cuda` when a CUDA device is present
    /// (`cuda_present`) and the task has CUDA kernels (`task_has`), else `cpu`; `mlx` is
    /// `mlx-metal` on macOS and `mlx-cuda` elsewhere; the others are themselves.
    pub fn resolve(
        requested: &str,
        cuda_present: impl FnOnce() -> bool,
        task_has: impl Fn(Backend) -> bool,
    ) -> Result<Backend, UnknownBackend> {
        match requested {
            "auto" => Ok(if task_has(Backend::Cuda) && cuda_present() {
                Backend::Cuda
            } else {
                Backend::Cpu
            }),
            "mlx" => Ok(if cfg!(target_os = "macos") {
                Backend::MlxMetal
            } else {
                Backend::MlxCuda
            }),
            other => other.parse(),
        }
    }
}

/// A back-end name that is none of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownBackend(pub String);

impl fmt::Display for UnknownBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = Backend::ALL.iter().map(|b| b.name()).collect();
        write!(
            f,
            "unknown back-end `{}` (use auto, {}, or mlx for the MLX back-end of this machine)",
            self.0,
            names.join(", ")
        )
    }
}

impl std::error::Error for UnknownBackend {}

impl FromStr for Backend {
    type Err = UnknownBackend;

    fn from_str(s: &str) -> Result<Backend, UnknownBackend> {
        Backend::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| UnknownBackend(s.to_string()))
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `pad`, so that widths and alignment (`{:<8}`) apply.
        f.pad(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_text_and_serde() {
        for b in Backend::ALL {
            assert_eq!(b.name().parse::<Backend>(), Ok(b));
            assert_eq!(b.to_string(), b.name());
            assert_eq!(format!("{b:<9}|"), format!("{:<9}|", b.name()));
            let js = serde_json::to_string(&b).unwrap();
            assert_eq!(js, format!("\"{}\"", b.name()));
            assert_eq!(serde_json::from_str::<Backend>(&js).unwrap(), b);
        }
        let e = "rocm".parse::<Backend>().unwrap_err().to_string();
        assert!(e.contains("`rocm`") && e.contains("cpu, cuda, mlx-cuda, mlx-metal"), "{e}");
        assert!(serde_json::from_str::<Backend>("\"metal\"").is_err());
    }

    #[test]
    fn auto_is_cuda_only_with_a_device_and_cuda_kernels() {
        let all = |_: Backend| true;
        let cpu_only = |b: Backend| b == Backend::Cpu;
        assert_eq!(Backend::resolve("auto", || true, all), Ok(Backend::Cuda));
        assert_eq!(Backend::resolve("auto", || false, all), Ok(Backend::Cpu));
        assert_eq!(Backend::resolve("auto", || true, cpu_only), Ok(Backend::Cpu));
        assert_eq!(Backend::resolve("cuda", || false, cpu_only), Ok(Backend::Cuda));
        assert!(Backend::resolve("mlx", || false, all).unwrap().is_mlx());
        assert!(Backend::resolve("gpu", || true, all).is_err());
    }

    #[test]
    fn properties_follow_the_back_end() {
        assert_eq!(Backend::MlxCuda.lang(), Lang::MlxCuda);
        assert_eq!(Backend::MlxCuda.dialect(), Dialect::Cuda);
        assert_eq!(Backend::MlxMetal.vendor(), Vendor::Apple);
        assert!(!Backend::Cpu.is_gpu() && Backend::Cuda.is_gpu());
    }
}
