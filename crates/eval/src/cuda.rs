//! The CUDA back-end: CUDA C++ candidates compiled by NVRTC to CUBIN for the device's own
//! architecture, launched through the driver API in the order the candidate declares, checked
//! element by element against a reference (the host f64 reference for small workloads, trusted
//! device references in `cuda/reference.cu` for large ones) and timed with CUDA events.
//!
//! A device fault (illegal address, misaligned access, trap) leaves the context unusable: the
//! worker prints the CUDA error on stderr and exits, and the supervisor reports a crash and
//! starts a fresh worker. A kernel that never ends is killed by the supervisor's run time-out.
//!
//! Compiling needs only `libnvrtc.so.13` (no GPU, no driver): see [`compile_check`] and
//! [`nvrtc_check`], used by `ksearch nvrtc-check` in CI.

use std::collections::BTreeMap;
use std::ffi::{CString, c_void};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::Instant;

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::nvrtc::result as nv;
use cudarc::nvrtc::sys as nvsys;

use ksearch_core::expr::eval_i64;
use ksearch_core::protocol::{CompileInfo, EvalReply, EvalRequest, Failure, FailureClass, Lang, Resources, WorkloadReq};
use ksearch_core::task::{DType, KernelSpec, Task, Workload};

use crate::Backend;
use crate::common::{HostTensor, host_reference, output_specs, panic_message, quiet_catch};
use crate::judge::{Device, Peaks, ReadBack, Stop as JStop, judge_request};

/// The trusted device references (compiled once per worker).
pub const REFERENCE_SOURCE: &str = include_str!("cuda/reference.cu");

/// Bytes of guard zone on each side of every output buffer (keeps 256-byte alignment).
const GUARD: usize = 4096;
const GUARD_BYTE: u8 = 0xCD;
/// Scratch buffers start filled with this byte: the ABI does not promise zeroed scratch.
const SCRATCH_BYTE: u8 = 0xFF;
/// Workloads with fewer reference flops than this are checked against the host f64 reference.
pub const HOST_REFERENCE_MAX_FLOPS: f64 = 5e7;
/// Generous peaks for the floor (the kb hardware profile will replace them).
pub const PEAK_FLOPS: f64 = 1000e12;
pub const PEAK_TRANSCENDENTALS: f64 = 4.5e12;
/// The byte floor is this fraction of bytes / measured copy bandwidth: a kernel that mostly reads
/// can beat a copy by a little, and part of its output may still sit in L2 when timing ends.
pub const FLOOR_SLACK: f64 = 0.8;
/// Event pairs available for one batch of timed repetitions.
const EVENT_PAIRS: usize = 32;
/// Exit code of a worker whose context died (device fault).
pub const FAULT_EXIT_CODE: i32 = 75;
/// Modules kept loaded before the cache is emptied.
const MAX_MODULES: usize = 64;

// ---------------------------------------------------------------------------------------------
// Availability

/// Is `libnvrtc` loadable (enough for compiling to CUBIN without a GPU)?
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to open the shared library.
    unsafe { nvsys::is_culib_present() }
}

/// Is there a CUDA driver with at least one device? Never panics.
pub fn cuda_available() -> bool {
    // SAFETY: only tries to open the shared library.
    if !unsafe { sys::is_culib_present() } {
        return false;
    }
    quiet_catch(|| cu::init().is_ok() && cu::device::get_count().map(|n| n > 0).unwrap_or(false)).unwrap_or(false)
}

/// Number of CUDA devices (0 without a driver). Never panics.
pub fn cuda_device_count() -> usize {
    // SAFETY: only tries to open the shared library.
    if !unsafe { sys::is_culib_present() } {
        return 0;
    }
    quiet_catch(|| {
        if cu::init().is_err() {
            return 0;
        }
        cu::device::get_count().map(|n| n.max(0) as usize).unwrap_or(0)
    })
    .unwrap_or(0)
}

/// NVRTC's version, e.g. (13, 0).
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    if !nvrtc_available() {
        return Err(no_nvrtc());
    }
    quiet_catch(|| {
        let (mut a, mut b) = (0, 0);
        // SAFETY: two out-parameters.
        unsafe { nvsys::nvrtcVersion(&mut a, &mut b) }
            .result()
            .map(|_| (a, b))
            .map_err(|e| format!("nvrtcVersion failed: {e:?}"))
    })?
}

fn no_nvrtc() -> String {
    "no NVRTC found (libnvrtc.so.13): install it (pip install 'nvidia-cuda-nvrtc==13.0.*') and put \
     site-packages/nvidia/cu13/lib on LD_LIBRARY_PATH"
        .into()
}

fn drv_err(e: cu::DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    match e.error_string() {
        Ok(s) => format!("{name} ({})", s.to_string_lossy()),
        Err(_) => name,
    }
}

// ---------------------------------------------------------------------------------------------
// Compiling

/// A compiled module image (CUBIN, or NUL-terminated PTX for a virtual architecture).
#[derive(Debug, Clone)]
pub struct Compiled {
    pub image: Vec<u8>,
    pub log: String,
    pub cached: bool,
    pub seconds: f64,
    /// The cache key (hash of source, options and NVRTC version).
    pub key: String,
}

/// NVRTC options for `arch` (e.g. `sm_90`, `sm_90a`) with `-D` defines (name, value).
pub fn nvrtc_options(arch: &str, defines: &[(String, String)], extra: &[String]) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "--ptxas-options=-v".to_string(),
        "--std=c++17".to_string(),
        "-DKS_CUDA=1".to_string(),
    ];
    o.extend(cuda_include_dir().map(|d| format!("--include-path={}", d.display())));
    o.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    o.extend(extra.iter().cloned());
    o
}

/// Where the CUDA headers (`cuda_fp16.h`, `cuda_bf16.h`, ...) are, for candidates that include
/// them (NVRTC 13.0 bundles none): `KSEARCH_CUDA_INCLUDE`, `$CUDA_HOME/include`,
/// `$CUDA_PATH/include`, `/usr/local/cuda/include`, or `../include` beside an
/// `LD_LIBRARY_PATH` entry (the pip wheels `nvidia-cuda-runtime` + `nvidia-cuda-nvrtc` put
/// them in `nvidia/cu13/include`). The first folder holding `cuda_fp16.h` wins.
pub fn cuda_include_dir() -> Option<PathBuf> {
    static DIR: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let mut c: Vec<PathBuf> = Vec::new();
        if let Ok(v) = std::env::var("KSEARCH_CUDA_INCLUDE") {
            c.extend(v.split(':').filter(|s| !s.is_empty()).map(PathBuf::from));
        }
        for var in ["CUDA_HOME", "CUDA_PATH"] {
            if let Ok(v) = std::env::var(var) {
                c.push(Path::new(&v).join("include"));
            }
        }
        c.push("/usr/local/cuda/include".into());
        c.push("/usr/local/cuda/targets/x86_64-linux/include".into());
        if let Ok(v) = std::env::var("LD_LIBRARY_PATH") {
            for d in v.split(':').filter(|s| !s.is_empty()) {
                if let Some(parent) = Path::new(d).parent() {
                    c.push(parent.join("include"));
                }
            }
        }
        c.into_iter().find(|d| d.join("cuda_fp16.h").is_file())
    })
    .clone()
}

fn c_chars_to_string(v: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = v.iter().map(|c| *c as u8).take_while(|b| *b != 0).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Compile `source` with NVRTC. `Err` carries the compiler log.
pub fn nvrtc_compile(source: &str, name: &str, options: &[String]) -> Result<(Vec<u8>, String), String> {
    if !nvrtc_available() {
        return Err(no_nvrtc());
    }
    let src = CString::new(source).map_err(|_| "source contains a NUL byte".to_string())?;
    let cname = CString::new(name).unwrap_or_else(|_| c"kernel.cu".to_owned());
    let opts: Vec<String> = options.iter().filter(|o| !o.contains('\0')).cloned().collect();
    quiet_catch(move || {
        let prog = nv::create_program(&src, Some(&cname)).map_err(|e| format!("nvrtcCreateProgram failed: {e:?}"))?;
        // SAFETY: `prog` was just created and is destroyed once below.
        unsafe {
            let res = nv::compile_program(prog, &opts);
            let log = nv::get_program_log(prog).map(|l| c_chars_to_string(&l)).unwrap_or_default();
            if let Err(e) = res {
                let _ = nv::destroy_program(prog);
                let log = if log.trim().is_empty() { format!("{e:?}") } else { log };
                return Err(log);
            }
            let mut size = 0usize;
            let mut image = Vec::new();
            if nvsys::nvrtcGetCUBINSize(prog, &mut size).result().is_ok() && size > 0 {
                image = vec![0u8; size];
                if nvsys::nvrtcGetCUBIN(prog, image.as_mut_ptr() as *mut std::ffi::c_char)
                    .result()
                    .is_err()
                {
                    image.clear();
                }
            }
            if image.is_empty() {
                // A virtual architecture: the driver compiles the PTX at load time.
                let ptx = nv::get_ptx(prog).map_err(|e| format!("nvrtcGetPTX failed: {e:?}"));
                let _ = nv::destroy_program(prog);
                let mut p: Vec<u8> = ptx?.iter().map(|c| *c as u8).take_while(|b| *b != 0).collect();
                p.push(0);
                return Ok((p, log));
            }
            let _ = nv::destroy_program(prog);
            Ok((image, log))
        }
    })?
}

fn hash_key(parts: &[&str]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0u8]);
    }
    h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect()
}

/// Compile with a cache under `cache` keyed by source, options and NVRTC version.
pub fn compile_cached(cache: Option<&Path>, source: &str, options: &[String]) -> Result<Compiled, String> {
    let (ma, mi) = nvrtc_version()?;
    let version = format!("nvrtc {ma}.{mi}");
    let key = hash_key(&[source, &options.join("\n"), &version]);
    if let Some(dir) = cache {
        let bin = dir.join(format!("{key}.cubin"));
        let log = dir.join(format!("{key}.log"));
        if let (Ok(image), Ok(log)) = (std::fs::read(&bin), std::fs::read_to_string(&log))
            && !image.is_empty()
        {
            return Ok(Compiled {
                image,
                log,
                cached: true,
                seconds: 0.0,
                key,
            });
        }
    }
    let t = Instant::now();
    let (image, log) = nvrtc_compile(source, "candidate.cu", options)?;
    let seconds = t.elapsed().as_secs_f64();
    if let Some(dir) = cache
        && std::fs::create_dir_all(dir).is_ok()
    {
        let pid = std::process::id();
        let tmp_bin = dir.join(format!("{key}.{pid}.cubin.tmp"));
        let tmp_log = dir.join(format!("{key}.{pid}.log.tmp"));
        if std::fs::write(&tmp_log, &log).is_ok() && std::fs::write(&tmp_bin, &image).is_ok() {
            let _ = std::fs::rename(&tmp_log, dir.join(format!("{key}.log")));
            let _ = std::fs::rename(&tmp_bin, dir.join(format!("{key}.cubin")));
        }
        let _ = std::fs::remove_file(&tmp_bin);
        let _ = std::fs::remove_file(&tmp_log);
    }
    Ok(Compiled {
        image,
        log,
        cached: false,
        seconds,
        key,
    })
}

fn num_before(line: &str, pat: &str) -> Option<u64> {
    let i = line.find(pat)?;
    line[..i]
        .split(|c: char| !c.is_ascii_digit())
        .rfind(|s| !s.is_empty())?
        .parse()
        .ok()
}

/// Parse ptxas's `-v` report (as NVRTC logs it) into [`Resources`]: the largest register count,
/// shared memory and stack frame over the reported functions, spills summed.
pub fn parse_ptxas(log: &str) -> Resources {
    let mut r = Resources::default();
    let mut raw = Vec::new();
    for line in log.lines() {
        let l = line.trim();
        let mut keep = false;
        if l.contains("registers") && l.contains("Used") {
            keep = true;
            if let Some(n) = num_before(l, " registers") {
                r.registers = Some(r.registers.unwrap_or(0).max(n as u32));
            }
            let smem = num_before(l, " bytes smem").unwrap_or(0);
            r.shared_bytes = Some(r.shared_bytes.unwrap_or(0).max(smem));
        }
        if l.contains("stack frame") {
            keep = true;
            if let Some(n) = num_before(l, " bytes stack frame") {
                r.stack_bytes = Some(r.stack_bytes.unwrap_or(0).max(n));
            }
            if let Some(n) = num_before(l, " bytes spill stores") {
                r.spill_stores = Some(r.spill_stores.unwrap_or(0) + n);
            }
            if let Some(n) = num_before(l, " bytes spill loads") {
                r.spill_loads = Some(r.spill_loads.unwrap_or(0) + n);
            }
        }
        if l.contains("Compiling entry function") || l.contains("Function properties for") {
            keep = true;
        }
        if keep {
            raw.push(l.trim_start_matches("ptxas info    :").trim().to_string());
        }
    }
    r.raw = raw.join("\n");
    r
}

/// Entry functions ptxas compiled (from `Compiling entry function 'NAME'` lines).
pub fn compiled_entries(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|l| {
            let i = l.find("Compiling entry function '")?;
            let rest = &l[i + "Compiling entry function '".len()..];
            Some(rest[..rest.find('\'')?].to_string())
        })
        .collect()
}

/// Compile-check `source` for `arch` (e.g. `sm_90`) with `-D` defines; no GPU needed.
pub fn compile_check(source: &str, defines: &[(String, String)], arch: &str) -> Result<Resources, String> {
    let opts = nvrtc_options(arch, defines, &[]);
    nvrtc_compile(source, "check.cu", &opts).map(|(_, log)| parse_ptxas(&log))
}

/// `-D` defines of a candidate: the task's constants as `KS_NAME`, then the tunables.
pub fn candidate_defines(task: &Task, defines: &BTreeMap<String, i64>) -> Vec<(String, String)> {
    let mut d: Vec<(String, String)> = task
        .constants
        .iter()
        .map(|(k, v)| (format!("KS_{}", k.to_uppercase()), format!("{v:?}")))
        .collect();
    d.extend(defines.iter().map(|(k, v)| (k.clone(), v.to_string())));
    d
}

/// The architecture to build for: `options.arch` if given, else `sm_XY` of the device, with the
/// `a` suffix (sm_90a) when the source uses arch-specific instructions (wgmma, setmaxnreg) or
/// `options.arch_specific` is true.
pub fn candidate_arch(cc: (i32, i32), source: &str, options: &BTreeMap<String, serde_json::Value>) -> String {
    if let Some(a) = options.get("arch").and_then(|v| v.as_str()) {
        return a.to_string();
    }
    let mut a = format!("sm_{}{}", cc.0, cc.1);
    let specific = options.get("arch_specific").and_then(|v| v.as_bool()).unwrap_or(false)
        || source.contains("wgmma")
        || source.contains("setmaxnreg");
    if specific && cc.0 >= 9 {
        a.push('a');
    }
    a
}

/// PTX of a candidate for the CPU's PTX interpreter (`ksearch kb emulate --backend cuda`): the
/// build the CUDA back-end makes for an sm_90 device (the same defines and flags, the `a` suffix
/// where the source needs it), for the matching virtual architecture (`compute_90`/`compute_90a`).
pub fn emulation_ptx(
    task: &Task,
    source: &str,
    options: &BTreeMap<String, serde_json::Value>,
    defines: &BTreeMap<String, i64>,
    mlx_unit: bool,
) -> Result<String, String> {
    let arch = candidate_arch((9, 0), source, options).replacen("sm_", "compute_", 1);
    let mut extra = extra_flags(options);
    if mlx_unit {
        // As MLX's worker builds a whole CUDA unit: 32-bit axes.
        extra.extend(crate::mlx_cuda::unit_flags());
    }
    let opts: Vec<String> = nvrtc_options(&arch, &candidate_defines(task, defines), &extra)
        .into_iter()
        .filter(|o| !o.starts_with("--ptxas-options"))
        .collect();
    let (image, _log) = nvrtc_compile(source, "kernel.cu", &opts)?;
    let text: Vec<u8> = image.into_iter().take_while(|b| *b != 0).collect();
    String::from_utf8(text).map_err(|_| "NVRTC's PTX is not UTF-8".to_string())
}

fn extra_flags(options: &BTreeMap<String, serde_json::Value>) -> Vec<String> {
    options
        .get("nvrtc_flags")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().filter_map(|x| x.as_str().map(String::from)).collect())
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// nvrtc-check (CI, no GPU)

/// Tunable configurations of `k` admitted by its constraints for at least one of `workloads`;
/// when there are more than `max`, the default configuration plus an even sample. A product of more
/// than `ENUM_CAP` configurations is not enumerated: the candidates are then the defaults, each value
/// alone beside them, and `ENUM_CAP` configurations spread over the whole product (a stride coprime
/// with its size), so every tunable's values appear and the defaults are never cut off.
pub fn admitted_configs(k: &KernelSpec, workloads: &[Workload], max: usize) -> Vec<BTreeMap<String, i64>> {
    const ENUM_CAP: u128 = 200_000;
    let sizes: Vec<u128> = k.tunables.iter().map(|t| t.values.len().max(1) as u128).collect();
    let total: u128 = sizes.iter().product();
    // configuration number i of the product, the last tunable varying fastest
    let decode = |mut i: u128| -> BTreeMap<String, i64> {
        let mut c = BTreeMap::new();
        for (t, s) in k.tunables.iter().zip(&sizes).rev() {
            if let Some(v) = t.values.get((i % s) as usize) {
                c.insert(t.name.clone(), *v);
            }
            i /= s;
        }
        c
    };
    let all: Vec<BTreeMap<String, i64>> = if total <= ENUM_CAP {
        (0..total).map(decode).collect()
    } else {
        let def = k.default_config();
        let mut cands = vec![def.clone()];
        for t in &k.tunables {
            for v in &t.values {
                let mut c = def.clone();
                c.insert(t.name.clone(), *v);
                cands.push(c);
            }
        }
        // a prime stride: coprime with the product's size unless it divides it
        let stride: u128 = if total.is_multiple_of(2_654_435_761) {
            1
        } else {
            2_654_435_761
        };
        cands.extend((0..ENUM_CAP).map(|j| decode(j * stride % total)));
        let mut seen = std::collections::BTreeSet::new();
        cands.into_iter().filter(|c| seen.insert(c.clone())).collect()
    };
    let ok: Vec<BTreeMap<String, i64>> = all
        .into_iter()
        .filter(|c| workloads.iter().any(|w| k.admits(c, w).unwrap_or(false)))
        .collect();
    if ok.len() <= max.max(1) {
        return ok;
    }
    let def = k.default_config();
    let mut out = Vec::new();
    let mut taken = std::collections::BTreeSet::new();
    if ok.contains(&def) {
        taken.insert(def.clone());
        out.push(def);
    }
    let want = max.max(1);
    let step = ok.len() as f64 / want as f64;
    let mut i = 0.0;
    while out.len() < want && (i as usize) < ok.len() {
        let c = &ok[i as usize];
        if taken.insert(c.clone()) {
            out.push(c.clone());
        }
        i += step;
    }
    out
}

fn config_label(c: &BTreeMap<String, i64>) -> String {
    if c.is_empty() {
        return "defaults".into();
    }
    c.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

fn short_resources(r: &Resources) -> String {
    format!(
        "{} regs, {} B smem, {} B stack, spills {}/{}",
        r.registers.unwrap_or(0),
        r.shared_bytes.unwrap_or(0),
        r.stack_bytes.unwrap_or(0),
        r.spill_stores.unwrap_or(0),
        r.spill_loads.unwrap_or(0)
    )
}

/// Compile-check the device references and every shipped CUDA kernel of `tasks` (seed and
/// kernels of `[backends.cuda]`) for every admitted tunable configuration (or a sample of
/// `max_configs`), for `arch`. The compiles run on every core (NVRTC compiles separate programs
/// on separate threads); one line per compile goes to `report`, in the order of the kernels and
/// configurations. Returns (compiles, failures).
pub fn nvrtc_check(tasks: &[Task], arch: &str, max_configs: usize, report: &mut dyn FnMut(&str)) -> (usize, usize) {
    let (mut n, mut failed) = (0usize, 0usize);
    n += 1;
    match compile_check(REFERENCE_SOURCE, &[], arch) {
        Ok(r) => report(&format!("ok    device references ({})", short_resources(&r))),
        Err(e) => {
            failed += 1;
            report(&format!("FAIL  device references:\n{}", indent(&e)));
        }
    }
    // What to compile, in order: (label, source, file, options, entry points), or a line that
    // fails without compiling.
    enum Job<'a> {
        Compile {
            label: String,
            kernel: &'a ksearch_core::KernelSpec,
            opts: Vec<String>,
        },
        Fail(String),
    }
    let mut jobs = Vec::new();
    for task in tasks {
        let Some(b) = task.backend(ksearch_core::Backend::Cuda) else {
            report(&format!("skip  {}: no [backends.cuda]", task.name));
            continue;
        };
        let workloads: Vec<Workload> = b.search.clone();
        for k in task.kernels(ksearch_core::Backend::Cuda) {
            let configs = admitted_configs(k, &workloads, max_configs);
            if configs.is_empty() {
                jobs.push(Job::Fail(format!(
                    "FAIL  {}/{}: no tunable configuration is admitted by the constraints for any search workload",
                    task.name, k.name
                )));
                continue;
            }
            for c in configs {
                let defines = candidate_defines(task, &c);
                jobs.push(Job::Compile {
                    label: format!("{}/{} [{}]", task.name, k.name, config_label(&c)),
                    kernel: k,
                    opts: nvrtc_options(&candidate_arch_for_check(arch, &k.source), &defines, &[]),
                });
            }
        }
    }
    let check = |job: &Job| -> (bool, String) {
        match job {
            Job::Fail(line) => (false, line.clone()),
            Job::Compile { label, kernel: k, opts } => match nvrtc_compile(&k.source, &k.file, opts) {
                Ok((_, log)) => {
                    let entries = compiled_entries(&log);
                    let missing: Vec<&String> = k.launches.iter().map(|l| &l.entry).filter(|e| !entries.contains(e)).collect();
                    if missing.is_empty() {
                        (true, format!("ok    {label} ({})", short_resources(&parse_ptxas(&log))))
                    } else {
                        (
                            false,
                            format!(
                                "FAIL  {label}: entry point(s) {missing:?} not compiled (have {entries:?}; declare them extern \"C\" __global__)"
                            ),
                        )
                    }
                }
                Err(e) => (false, format!("FAIL  {label}:\n{}", indent(&first_lines(&e, 40)))),
            },
        }
    };
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(jobs.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        for _ in 0..threads {
            let tx = tx.clone();
            let (jobs, next, check) = (&jobs, &next, &check);
            s.spawn(move || {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(job) = jobs.get(i) else { break };
                    if tx.send((i, check(job))).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        // Lines in job order, each as soon as the ones before it are in.
        let mut done: std::collections::BTreeMap<usize, (bool, String)> = Default::default();
        let mut at = 0;
        for (i, r) in rx {
            done.insert(i, r);
            while let Some((ok, line)) = done.remove(&at) {
                n += 1;
                if !ok {
                    failed += 1;
                }
                report(&line);
                at += 1;
            }
        }
    });
    (n, failed)
}

fn candidate_arch_for_check(arch: &str, source: &str) -> String {
    let specific = source.contains("wgmma") || source.contains("setmaxnreg");
    if specific && !arch.ends_with('a') && arch.starts_with("sm_9") {
        format!("{arch}a")
    } else {
        arch.to_string()
    }
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("      {l}")).collect::<Vec<_>>().join("\n")
}

fn first_lines(s: &str, n: usize) -> String {
    s.lines().take(n).collect::<Vec<_>>().join("\n")
}

// ---------------------------------------------------------------------------------------------
// ---------------------------------------------------------------------------------------------
// Device memory

/// A device allocation, freed on drop.
struct DevBuf {
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DevBuf {
    fn alloc(bytes: usize) -> Result<DevBuf, cu::DriverError> {
        // SAFETY: plain allocation in the current context.
        let ptr = unsafe { cu::malloc_sync(bytes.max(256)) }?;
        Ok(DevBuf { ptr, bytes })
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_sync and freed once.
        let _ = unsafe { cu::free_sync(self.ptr) };
    }
}

/// Why a step failed.
enum Stop {
    /// A classified failure of the candidate; the context is fine.
    Fail(Failure),
    /// The context is dead (device fault): the worker must exit.
    Fault(String),
}

fn fail(class: FailureClass, message: impl Into<String>) -> Stop {
    Stop::Fail(Failure {
        class,
        message: message.into(),
    })
}

/// Errors that leave the context unusable.
fn is_sticky(e: &cu::DriverError) -> bool {
    use sys::CUresult::*;
    matches!(
        e.0,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_LAUNCH_TIMEOUT
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_ECC_UNCORRECTABLE
            | CUDA_ERROR_UNKNOWN
            | CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

/// An error from an operation that follows candidate launches in the stream.
fn after_run(e: cu::DriverError, what: &str) -> Stop {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return fail(FailureClass::OutOfMemory, format!("{what}: {}", drv_err(e)));
    }
    Stop::Fault(format!("{what}: {}", drv_err(e)))
}

fn alloc(bytes: usize, what: &str) -> Result<DevBuf, Stop> {
    DevBuf::alloc(bytes).map_err(|e| {
        if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            fail(
                FailureClass::OutOfMemory,
                format!("cannot allocate {bytes} bytes for {what}: {}", drv_err(e)),
            )
        } else if is_sticky(&e) {
            Stop::Fault(format!("allocating {what}: {}", drv_err(e)))
        } else {
            fail(
                FailureClass::Infra,
                format!("cannot allocate {bytes} bytes for {what}: {}", drv_err(e)),
            )
        }
    })
}

/// One kernel argument, passed as 8 bytes (pointer, `long long` or `double`).
#[derive(Clone, Copy)]
enum Arg {
    Ptr(sys::CUdeviceptr),
    I64(i64),
    F64(f64),
}

fn arg_words(args: &[Arg]) -> Vec<u64> {
    args.iter()
        .map(|a| match *a {
            Arg::Ptr(p) => p,
            Arg::I64(v) => v as u64,
            Arg::F64(v) => v.to_bits(),
        })
        .collect()
}

/// Launch `f`; `Err` is the driver's refusal.
///
/// # Safety
/// `f` must be a live function whose parameters are all 8 bytes wide and match `args`.
unsafe fn launch(
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared: u32,
    stream: sys::CUstream,
    args: &[Arg],
) -> Result<(), cu::DriverError> {
    let mut words = arg_words(args);
    let mut params: Vec<*mut c_void> = words.iter_mut().map(|w| w as *mut u64 as *mut c_void).collect();
    // SAFETY: per the caller; the parameter values are copied by cuLaunchKernel.
    unsafe { cu::launch_kernel(f, grid, block, shared, stream, &mut params) }
}

fn func_attr(f: sys::CUfunction, a: sys::CUfunction_attribute) -> Option<i64> {
    // SAFETY: `f` is a live function.
    unsafe { cu::function::get_function_attribute(f, a) }.ok().map(|v| v as i64)
}

/// A launch with its sizes evaluated for one workload.
struct Planned {
    f: sys::CUfunction,
    entry: String,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared: u32,
}

// ---------------------------------------------------------------------------------------------
// The back-end

pub struct CudaBackend {
    ordinal: usize,
    cache: PathBuf,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    stream: sys::CUstream,
    name: String,
    cc: (i32, i32),
    sms: i32,
    l2_bytes: usize,
    smem_optin: usize,
    max_threads: i64,
    max_grid: [i64; 3],
    /// Device-to-device copy bandwidth, bytes/s (read + written).
    copy_bps: f64,
    flush: DevBuf,
    events: Vec<sys::CUevent>,
    modules: BTreeMap<String, sys::CUmodule>,
    refmod: Option<sys::CUmodule>,
    host_ref_max_flops: f64,
    /// This device's measurement lock, shared with the other workers of the device.
    lock: crate::common::DeviceLock,
    /// Page-locked host memory that read-backs go through (made on first use).
    staging: Option<Pinned>,
    /// Host buffers the judge is done with, kept for the next read-backs and references: a
    /// fresh allocation of hundreds of megabytes takes a page fault per 4 KB page on first write.
    spare_bytes: Vec<Vec<u8>>,
    spare_f64: Vec<Vec<f64>>,
}

/// Spare host buffers kept per kind.
const SPARE_BUFFERS: usize = 8;

/// A buffer of `n` zeroed elements: the smallest spare one that is large enough, or a new one.
fn take_spare<T: Copy + Default>(spare: &mut Vec<Vec<T>>, n: usize) -> Vec<T> {
    let best = spare
        .iter()
        .enumerate()
        .filter(|(_, v)| v.capacity() >= n)
        .min_by_key(|(_, v)| v.capacity())
        .map(|(i, _)| i);
    let mut v = match best {
        Some(i) => spare.swap_remove(i),
        None => Vec::with_capacity(n),
    };
    v.clear();
    v.resize(n, T::default());
    v
}

/// Keep `bufs` for later, at most `SPARE_BUFFERS` of them, the largest.
fn keep_spare<T>(spare: &mut Vec<Vec<T>>, bufs: Vec<Vec<T>>) {
    spare.extend(bufs.into_iter().filter(|v| v.capacity() >= 1 << 20));
    if spare.len() > SPARE_BUFFERS {
        spare.sort_by_key(|v| std::cmp::Reverse(v.capacity()));
        spare.truncate(SPARE_BUFFERS);
    }
}

/// A page-locked host buffer: device-to-host copies into it run at the link's speed, where a
/// copy into ordinary (pageable) memory goes through the driver's own bounce buffers.
struct Pinned {
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: the buffer is plain host memory owned by one backend; nothing else aliases it.
unsafe impl Send for Pinned {}

/// Read-backs larger than this go through the staging buffer in pieces.
const STAGING_BYTES: usize = 64 << 20;

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `CudaBackend::download` and freed once.
        let _ = unsafe { cu::free_host(self.ptr as *mut c_void) };
    }
}

fn dev_attr(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> Result<i32, String> {
    // SAFETY: `dev` is a valid device handle.
    unsafe { cu::device::get_attribute(dev, a) }.map_err(|e| format!("cuDeviceGetAttribute({a:?}): {}", drv_err(e)))
}

impl CudaBackend {
    /// Open device `device` (its primary context), measure its copy bandwidth and prepare the
    /// L2 flush buffer. Fails with one clear line when there is no driver, device or NVRTC.
    pub fn new(device: usize, cache: PathBuf) -> Result<CudaBackend, String> {
        // A reference the task brings is compiled for the host into this back-end's cache.
        crate::task_ref::set_cache_dir(cache.clone());
        // SAFETY: only tries to open the shared library.
        if !unsafe { sys::is_culib_present() } {
            return Err("no CUDA driver found (libcuda.so): the library cannot be loaded on this machine".into());
        }
        if !nvrtc_available() {
            return Err(no_nvrtc());
        }
        match quiet_catch(|| CudaBackend::open(device, cache)) {
            Ok(r) => r,
            Err(p) => Err(format!("no CUDA driver found (libcuda.so): {p}")),
        }
    }

    fn open(ordinal: usize, cache: PathBuf) -> Result<CudaBackend, String> {
        use sys::CUdevice_attribute::*;
        cu::init().map_err(|e| format!("no CUDA device: cuInit failed: {}", drv_err(e)))?;
        let count = cu::device::get_count().map_err(|e| format!("no CUDA device: {}", drv_err(e)))?;
        if ordinal as i64 >= count as i64 {
            return Err(format!("no CUDA device {ordinal} (this machine has {count})"));
        }
        let dev = cu::device::get(ordinal as i32).map_err(|e| format!("cuDeviceGet({ordinal}): {}", drv_err(e)))?;
        // SAFETY: retained once, released in Drop.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(|e| format!("cannot open device {ordinal}: {}", drv_err(e)))?;
        // SAFETY: `ctx` is live.
        unsafe { cu::ctx::set_current(ctx) }.map_err(|e| format!("cuCtxSetCurrent: {}", drv_err(e)))?;
        let name = cu::device::get_name(dev).unwrap_or_else(|_| "CUDA device".into());
        let cc = (
            dev_attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            dev_attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        let sms = dev_attr(dev, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let l2_bytes = dev_attr(dev, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?.max(0) as usize;
        let smem_optin = dev_attr(dev, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?.max(0) as usize;
        let max_threads = dev_attr(dev, CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)? as i64;
        let max_grid = [
            dev_attr(dev, CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)? as i64,
            dev_attr(dev, CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)? as i64,
            dev_attr(dev, CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)? as i64,
        ];
        let stream =
            cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| format!("cuStreamCreate: {}", drv_err(e)))?;
        let mut events = Vec::with_capacity(2 * EVENT_PAIRS);
        for _ in 0..2 * EVENT_PAIRS {
            events.push(
                cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| format!("cuEventCreate: {}", drv_err(e)))?,
            );
        }
        let flush_bytes = (2 * l2_bytes).max(64 << 20);
        let flush = DevBuf::alloc(flush_bytes).map_err(|e| format!("cannot allocate the L2 flush buffer: {}", drv_err(e)))?;
        // The physical GPU (an ordinal is relative to CUDA_VISIBLE_DEVICES, which a launcher
        // may set per worker): its PCI address.
        let pci = format!(
            "{:04x}.{:02x}.{:02x}",
            dev_attr(dev, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            dev_attr(dev, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            dev_attr(dev, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        );
        let lock = crate::common::DeviceLock::new(&cache, ksearch_core::Backend::Cuda, &pci);
        let mut b = CudaBackend {
            ordinal,
            cache,
            dev,
            ctx,
            stream,
            name,
            cc,
            sms,
            l2_bytes,
            smem_optin,
            max_threads,
            max_grid,
            copy_bps: 0.0,
            flush,
            events,
            modules: BTreeMap::new(),
            refmod: None,
            host_ref_max_flops: HOST_REFERENCE_MAX_FLOPS,
            lock,
            staging: None,
            spare_bytes: Vec::new(),
            spare_f64: Vec::new(),
        };
        // Measured while no other worker of the device measures.
        let hold = b.lock.acquire()?;
        let copy = b.measure_copy();
        b.lock.release(hold);
        b.copy_bps = copy.map_err(|e| format!("measuring copy bandwidth: {e}"))?;
        Ok(b)
    }

    /// Compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    /// Measured device-to-device copy bandwidth in bytes/s (read + written bytes).
    pub fn copy_bandwidth(&self) -> f64 {
        self.copy_bps
    }

    /// Workloads under this many reference flops use the host f64 reference (default 5e7);
    /// 0 forces the device reference wherever one exists.
    pub fn set_host_reference_limit(&mut self, flops: f64) {
        self.host_ref_max_flops = flops;
    }

    fn bind(&self) -> Result<(), String> {
        // SAFETY: `self.ctx` is live for the backend's life.
        unsafe { cu::ctx::set_current(self.ctx) }.map_err(|e| format!("cuCtxSetCurrent: {}", drv_err(e)))
    }

    fn sync(&self) -> Result<(), cu::DriverError> {
        // SAFETY: our stream.
        unsafe { cu::stream::synchronize(self.stream) }
    }

    fn elapsed_ms(&self, a: sys::CUevent, b: sys::CUevent) -> Result<f64, cu::DriverError> {
        // SAFETY: both events were recorded on our stream and have completed.
        unsafe { cu::event::elapsed(a, b) }.map(|x| x as f64)
    }

    /// Best of a few large device-to-device copies, bytes/s counting read + write.
    fn measure_copy(&mut self) -> Result<f64, String> {
        let n = (4 * self.l2_bytes).max(256 << 20);
        let a = DevBuf::alloc(n).map_err(drv_err)?;
        let b = DevBuf::alloc(n).map_err(drv_err)?;
        let (e0, e1) = (self.events[0], self.events[1]);
        let mut best = f64::INFINITY;
        // SAFETY: both buffers are n bytes; events and stream are ours.
        unsafe {
            cu::memset_d8_async(a.ptr, 1, n, self.stream).map_err(drv_err)?;
            cu::memcpy_dtod_async(b.ptr, a.ptr, n, self.stream).map_err(drv_err)?;
            for _ in 0..5 {
                cu::event::record(e0, self.stream).map_err(drv_err)?;
                cu::memcpy_dtod_async(b.ptr, a.ptr, n, self.stream).map_err(drv_err)?;
                cu::event::record(e1, self.stream).map_err(drv_err)?;
                self.sync().map_err(drv_err)?;
                best = best.min(self.elapsed_ms(e0, e1).map_err(drv_err)? / 1e3);
            }
        }
        Ok(2.0 * n as f64 / best.max(1e-9))
    }

    fn load_module(&mut self, c: &Compiled) -> Result<sys::CUmodule, String> {
        if let Some(m) = self.modules.get(&c.key) {
            return Ok(*m);
        }
        if self.modules.len() >= MAX_MODULES {
            for (_, m) in std::mem::take(&mut self.modules) {
                // SAFETY: no function of these modules is used any more.
                let _ = unsafe { cu::module::unload(m) };
            }
        }
        let mut image = c.image.clone();
        if image.last() != Some(&0) && !image.starts_with(b"\x7fELF") {
            image.push(0);
        }
        // SAFETY: `image` is a CUBIN or NUL-terminated PTX and outlives the call.
        let m = unsafe { cu::module::load_data(image.as_ptr() as *const c_void) }
            .map_err(|e| format!("cannot load the compiled module: {}", drv_err(e)))?;
        self.modules.insert(c.key.clone(), m);
        Ok(m)
    }

    fn reference_module(&mut self) -> Result<sys::CUmodule, String> {
        if let Some(m) = self.refmod {
            return Ok(m);
        }
        let arch = format!("sm_{}{}", self.cc.0, self.cc.1);
        let opts = nvrtc_options(&arch, &[], &[]);
        let c = compile_cached(Some(&self.cache), REFERENCE_SOURCE, &opts)
            .map_err(|log| format!("device references do not compile:\n{}", first_lines(&log, 20)))?;
        let m = self.load_module(&c)?;
        // Keep it out of the candidate module cache's eviction.
        self.modules.remove(&c.key);
        self.refmod = Some(m);
        Ok(m)
    }

    /// The trusted device reference for `inputs` (as f64, in the task's declared outputs).
    /// `Ok(None)`: no device reference for this task or shape (use the host one).
    pub fn device_reference(
        &mut self,
        task: &Task,
        w: &WorkloadReq,
        inputs: &[HostTensor],
    ) -> Result<Option<Vec<Vec<f64>>>, String> {
        self.bind()?;
        match self.device_reference_inner(task, w, inputs) {
            Ok(r) => Ok(r),
            Err(Stop::Fail(f)) => Err(f.message),
            Err(Stop::Fault(m)) => Err(format!("device fault in the device reference: {m}")),
        }
    }

    fn device_reference_inner(
        &mut self,
        task: &Task,
        w: &WorkloadReq,
        inputs: &[HostTensor],
    ) -> Result<Option<Vec<Vec<f64>>>, Stop> {
        let ax = |n: &str| w.axes.get(n).copied().unwrap_or(0);
        let entry = match task.reference.name().unwrap_or("") {
            "softmax" => "ksref_softmax",
            "rmsnorm" => "ksref_rmsnorm",
            "attention" if ax("D") <= 128 => "ksref_attention_tiled",
            "attention" => "ksref_attention",
            "mamba_scan" => "ksref_mamba_scan",
            "mamba_step" => "ksref_mamba_step",
            _ => return Ok(None),
        };
        let expected_inputs = match task.reference.name().unwrap_or("") {
            "softmax" => 1,
            "rmsnorm" => 2,
            "attention" => 3,
            "mamba_scan" => 6,
            _ => 7,
        };
        if inputs.len() != expected_inputs || task.outputs.is_empty() {
            return Ok(None);
        }
        let m = self.reference_module().map_err(|e| fail(FailureClass::Infra, e))?;
        let cname = CString::new(entry).expect("no NUL");
        // SAFETY: `m` is a live module.
        let f = unsafe { cu::module::get_function(m, cname) }
            .map_err(|e| fail(FailureClass::Infra, format!("device reference {entry}: {}", drv_err(e))))?;
        let outs = output_specs(task, ksearch_core::Backend::Cuda, w).map_err(|e| fail(FailureClass::Infra, e))?;
        let mut ibufs = Vec::new();
        for t in inputs {
            ibufs.push(self.upload_widened(m, t)?);
        }
        let mut obufs = Vec::new();
        for (_, n, _) in &outs {
            obufs.push(alloc(n * 8, "a reference output")?);
        }
        let mut args: Vec<Arg> = ibufs.iter().map(|b| Arg::Ptr(b.ptr)).collect();
        args.extend(obufs.iter().map(|b| Arg::Ptr(b.ptr)));
        let (grid, block, shared) = match task.reference.name().unwrap_or("") {
            "softmax" | "rmsnorm" => {
                let rows = ax("rows");
                args.extend([Arg::I64(rows), Arg::I64(ax("cols"))]);
                if task.reference.name() == Some("rmsnorm") {
                    args.push(Arg::F64(task.constants.get("eps").copied().unwrap_or(1e-5)));
                }
                if rows > self.max_grid[0] {
                    return Ok(None);
                }
                ((rows as u32, 1, 1), (256, 1, 1), 0)
            }
            "attention" => {
                let (b, h, l, d) = (ax("B"), ax("H"), ax("L"), ax("D"));
                // Grouped-query heads; a task without the axis has as many kv heads as heads.
                let hkv = if ax("Hkv") > 0 { ax("Hkv") } else { h };
                if d > 256 || b * h > self.max_grid[1] || hkv < 1 || h % hkv != 0 {
                    return Ok(None);
                }
                args.extend([Arg::I64(l), Arg::I64(d), Arg::I64(ax("causal")), Arg::I64(h), Arg::I64(hkv)]);
                // The tiled kernel: 4 warps of 4 rows per block; the other: 8 warps of 1 row.
                let (rows, threads) = if entry == "ksref_attention_tiled" {
                    (16, 128)
                } else {
                    (8, 256)
                };
                ((((l + rows - 1) / rows) as u32, (b * h) as u32, 1), (threads, 1, 1), 0)
            }
            _ => {
                let (bt, d, n) = (ax("batch"), ax("D"), ax("N"));
                if !(1..=1024).contains(&n) || bt > self.max_grid[1] {
                    return Ok(None);
                }
                let g = (64 / n).max(1);
                if task.reference.name() == Some("mamba_scan") {
                    args.extend([Arg::I64(bt), Arg::I64(ax("L")), Arg::I64(d), Arg::I64(n)]);
                } else {
                    args.extend([Arg::I64(bt), Arg::I64(d), Arg::I64(n)]);
                }
                (
                    (((d + g - 1) / g) as u32, bt as u32, 1),
                    (n as u32, g as u32, 1),
                    (g * n * 8) as u32,
                )
            }
        };
        if grid.0 == 0 || grid.1 == 0 {
            return Ok(Some(outs.iter().map(|(_, n, _)| vec![0.0; *n]).collect()));
        }
        // SAFETY: the reference kernels take 8-byte parameters in this order.
        unsafe { launch(f, grid, block, shared, self.stream, &args) }.map_err(|e| {
            if is_sticky(&e) {
                Stop::Fault(drv_err(e))
            } else {
                fail(FailureClass::Infra, format!("device reference launch: {}", drv_err(e)))
            }
        })?;
        self.sync().map_err(|e| after_run(e, "device reference"))?;
        let mut res = Vec::new();
        for ((_, n, _), b) in outs.iter().zip(&obufs) {
            let mut v = take_spare(&mut self.spare_f64, *n);
            self.download(&mut v, b.ptr).map_err(|e| after_run(e, "reference download"))?;
            res.push(v);
        }
        Ok(Some(res))
    }

    /// Copy `dst.len()` elements from device address `src` into `dst`, through the page-locked
    /// staging buffer, and wait for them. Falls back to a direct (pageable) copy when page-locked
    /// memory cannot be had.
    fn download<T: Copy>(&mut self, dst: &mut [T], src: sys::CUdeviceptr) -> Result<(), cu::DriverError> {
        let total = std::mem::size_of_val(dst);
        // SAFETY: a byte view of `dst` (plain `Copy` data, any bit pattern is overwritten).
        let bytes = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut u8, total) };
        if self.staging.is_none() && total > 0 {
            // SAFETY: a fresh page-locked allocation owned by `Pinned`.
            if let Ok(ptr) = unsafe { cu::malloc_host(STAGING_BYTES, 0) } {
                self.staging = Some(Pinned {
                    ptr: ptr as *mut u8,
                    bytes: STAGING_BYTES,
                });
            }
        }
        let Some(st) = &self.staging else {
            // SAFETY: `bytes` is exactly the destination.
            unsafe { cu::memcpy_dtoh_async(bytes, src, self.stream) }?;
            return self.sync();
        };
        let mut done = 0;
        while done < total {
            let n = (total - done).min(st.bytes);
            // SAFETY: the staging buffer holds `st.bytes >= n` bytes and nothing else uses it
            // while this copy runs (the stream is waited for before it is read).
            let piece = unsafe { std::slice::from_raw_parts_mut(st.ptr, n) };
            unsafe { cu::memcpy_dtoh_async(piece, src + done as u64, self.stream) }?;
            self.sync()?;
            bytes[done..done + n].copy_from_slice(piece);
            done += n;
        }
        Ok(())
    }

    /// One reference input on the device as doubles: its bytes uploaded in their own encoding
    /// and widened there (`ksref_widen_*`), or uploaded as doubles when already wide.
    fn upload_widened(&mut self, m: sys::CUmodule, t: &HostTensor) -> Result<DevBuf, Stop> {
        let n = t.len();
        let wide = alloc(n * 8, "a reference input")?;
        let entry = match t.dtype {
            DType::F16 => "ksref_widen_f16",
            DType::Bf16 => "ksref_widen_bf16",
            DType::F32 => "ksref_widen_f32",
            DType::F64 | DType::I32 => "",
        };
        if entry.is_empty() || t.bytes.len() != n * t.dtype.size() || n == 0 {
            let values = if t.values.len() == n {
                std::borrow::Cow::Borrowed(t.values.as_slice())
            } else {
                std::borrow::Cow::Owned(ksearch_core::data::decode(&t.bytes, t.dtype))
            };
            if values.len() != n {
                return Err(fail(
                    FailureClass::Infra,
                    format!("reference input `{}`: {} values for {n} elements", t.name, values.len()),
                ));
            }
            // SAFETY: the buffer holds exactly these values.
            unsafe { cu::memcpy_htod_async(wide.ptr, &values, self.stream) }.map_err(|e| after_run(e, "reference upload"))?;
            self.sync().map_err(|e| after_run(e, "reference upload"))?;
            return Ok(wide);
        }
        let raw = alloc(t.bytes.len(), "a reference input")?;
        // SAFETY: the buffer holds exactly these bytes.
        unsafe { cu::memcpy_htod_async(raw.ptr, &t.bytes, self.stream) }.map_err(|e| after_run(e, "reference upload"))?;
        let cname = CString::new(entry).expect("no NUL");
        // SAFETY: `m` is a live module.
        let f = unsafe { cu::module::get_function(m, cname) }
            .map_err(|e| fail(FailureClass::Infra, format!("device reference {entry}: {}", drv_err(e))))?;
        let blocks = n.div_ceil(256) as u32;
        let args = [Arg::Ptr(raw.ptr), Arg::Ptr(wide.ptr), Arg::I64(n as i64)];
        // SAFETY: the widening kernels take (source, destination, count), 8 bytes each.
        unsafe { launch(f, (blocks, 1, 1), (256, 1, 1), 0, self.stream, &args) }.map_err(|e| {
            if is_sticky(&e) {
                Stop::Fault(drv_err(e))
            } else {
                fail(FailureClass::Infra, format!("device reference {entry}: {}", drv_err(e)))
            }
        })?;
        // `raw` is freed when it drops, after the stream has widened it.
        self.sync().map_err(|e| after_run(e, "widening a reference input"))?;
        Ok(wide)
    }

    fn reference(&mut self, task: &Task, w: &WorkloadReq, inputs: &[HostTensor]) -> Result<Vec<Vec<f64>>, Stop> {
        let flops = task.flops(&w.axes);
        if flops >= self.host_ref_max_flops
            && let Some(r) = self.device_reference_inner(task, w, inputs)?
        {
            return Ok(r);
        }
        host_reference(task, w, inputs).map_err(|e| fail(FailureClass::Infra, e))
    }

    /// Evaluate the launch sizes for one workload and check them against the device's limits.
    fn plan(&self, req: &EvalRequest, fns: &[sys::CUfunction], w: &Workload) -> Result<Vec<Planned>, Stop> {
        use sys::CUfunction_attribute::*;
        let mut env = w.clone();
        env.extend(req.candidate.defines.iter().map(|(k, v)| (k.clone(), *v)));
        let mut out = Vec::new();
        for (i, (l, f)) in req.candidate.launches.iter().zip(fns).enumerate() {
            let at = format!("launch {} `{}`", i + 1, l.entry);
            let ev = |what: &str, e: &str| {
                eval_i64(e, &env).map_err(|err| fail(FailureClass::Launch, format!("{at}: {what} `{e}`: {err}")))
            };
            let mut g = [0i64; 3];
            let mut b = [0i64; 3];
            for k in 0..3 {
                g[k] = ev("grid", &l.grid[k])?;
                b[k] = ev("block", &l.block[k])?;
            }
            let shared = ev("shared", &l.shared)?;
            if g.iter().chain(&b).any(|v| *v < 1) {
                return Err(fail(
                    FailureClass::Launch,
                    format!("{at}: grid {g:?} / block {b:?} has a size below 1"),
                ));
            }
            for k in 0..3 {
                if g[k] > self.max_grid[k] {
                    return Err(fail(
                        FailureClass::Launch,
                        format!("{at}: grid {g:?} exceeds the device's maximum {:?}", self.max_grid),
                    ));
                }
            }
            let threads = b[0] * b[1] * b[2];
            if threads > self.max_threads || b[2] > 64 {
                return Err(fail(
                    FailureClass::Launch,
                    format!(
                        "{at}: block {b:?} ({threads} threads) exceeds the device's limit of {} threads",
                        self.max_threads
                    ),
                ));
            }
            let fmax = func_attr(*f, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK).unwrap_or(self.max_threads);
            if threads > fmax {
                let regs = func_attr(*f, CU_FUNC_ATTRIBUTE_NUM_REGS).unwrap_or(0);
                return Err(fail(
                    FailureClass::Launch,
                    format!(
                        "{at}: block of {threads} threads, but this kernel can run at most {fmax} per block ({regs} registers per thread): too many resources requested"
                    ),
                ));
            }
            let stat = func_attr(*f, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES).unwrap_or(0);
            if shared < 0 || (stat + shared) as usize > self.smem_optin {
                return Err(fail(
                    FailureClass::Launch,
                    format!(
                        "{at}: {shared} bytes of dynamic shared memory (+ {stat} static) exceed the device's {} bytes per block",
                        self.smem_optin
                    ),
                ));
            }
            if shared > 48 * 1024 - stat {
                // SAFETY: `f` is live.
                unsafe {
                    cu::function::set_function_attribute(*f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared as i32)
                }
                .map_err(|e| {
                    fail(
                        FailureClass::Launch,
                        format!("{at}: cannot allow {shared} bytes of dynamic shared memory: {}", drv_err(e)),
                    )
                })?;
            }
            out.push(Planned {
                f: *f,
                entry: l.entry.clone(),
                grid: (g[0] as u32, g[1] as u32, g[2] as u32),
                block: (b[0] as u32, b[1] as u32, b[2] as u32),
                shared: shared as u32,
            });
        }
        Ok(out)
    }

    fn run(&self, plan: &[Planned], args: &[Arg]) -> Result<(), Stop> {
        for (i, p) in plan.iter().enumerate() {
            // SAFETY: untrusted candidate code with the ABI's parameters (device pointers and
            // `long long` axes); a fault is caught at the next synchronisation.
            let r = unsafe { launch(p.f, p.grid, p.block, p.shared, self.stream, args) };
            if let Err(e) = r {
                let at = format!(
                    "launch {} `{}` (grid {:?}, block {:?}, {} B dynamic shared)",
                    i + 1,
                    p.entry,
                    p.grid,
                    p.block,
                    p.shared
                );
                return Err(if is_sticky(&e) {
                    Stop::Fault(format!("{at}: {}", drv_err(e)))
                } else {
                    fail(FailureClass::Launch, format!("{at} refused: {}", drv_err(e)))
                });
            }
        }
        Ok(())
    }

    fn eval_inner(&mut self, req: &EvalRequest, progress: &mut dyn FnMut(&str)) -> EvalReply {
        let mut reply = EvalReply {
            id: req.id,
            ..EvalReply::default()
        };
        if req.candidate.lang != Lang::Cuda {
            reply.failure = Some(Failure {
                class: FailureClass::Check,
                message: format!("the cuda back-end runs CUDA candidates, not {:?}", req.candidate.lang),
            });
            return reply;
        }
        if let Err(e) = self.bind() {
            reply.failure = Some(Failure {
                class: FailureClass::Infra,
                message: e,
            });
            return reply;
        }
        // NVRTC missing (or broken) is the machine's failure, not the candidate's.
        if let Err(e) = nvrtc_version() {
            reply.failure = Some(Failure {
                class: FailureClass::Infra,
                message: e,
            });
            return reply;
        }
        let c = &req.candidate;
        let arch = candidate_arch(self.cc, &c.source, &c.options);
        let opts = nvrtc_options(&arch, &candidate_defines(&req.task, &c.defines), &extra_flags(&c.options));
        let compiled = match compile_cached(Some(&self.cache), &c.source, &opts) {
            Ok(x) => x,
            Err(log) => {
                reply.failure = Some(Failure {
                    class: FailureClass::Compile,
                    message: first_lines(&log, 40),
                });
                return reply;
            }
        };
        reply.compile = CompileInfo {
            log: compiled.log.clone(),
            cached: compiled.cached,
            seconds: compiled.seconds,
        };
        reply.resources = parse_ptxas(&compiled.log);
        let module = match self.load_module(&compiled) {
            Ok(m) => m,
            Err(e) => {
                reply.failure = Some(Failure {
                    class: FailureClass::Compile,
                    message: e,
                });
                return reply;
            }
        };
        let mut fns = Vec::new();
        for l in &c.launches {
            let Ok(name) = CString::new(l.entry.clone()) else {
                reply.failure = Some(Failure {
                    class: FailureClass::Compile,
                    message: format!("bad entry name {:?}", l.entry),
                });
                return reply;
            };
            // SAFETY: `module` is live.
            match unsafe { cu::module::get_function(module, name) } {
                Ok(f) => fns.push(f),
                Err(_) => {
                    reply.failure = Some(Failure {
                        class: FailureClass::Compile,
                        message: format!(
                            "entry point `{0}` not found (declare it `extern \"C\" __global__ void {0}(...)`); compiled: {1:?}",
                            l.entry,
                            compiled_entries(&compiled.log)
                        ),
                    });
                    return reply;
                }
            }
        }
        if reply.resources.registers.is_none()
            && let Some(f) = fns.first()
        {
            use sys::CUfunction_attribute::*;
            reply.resources.registers = func_attr(*f, CU_FUNC_ATTRIBUTE_NUM_REGS).map(|v| v as u32);
            reply.resources.shared_bytes = func_attr(*f, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES).map(|v| v as u64);
            reply.resources.stack_bytes = func_attr(*f, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES).map(|v| v as u64);
        }
        progress("compiled");
        let placeholder = crate::common::DeviceLock::new(&self.cache, ksearch_core::Backend::Cuda, "none");
        let mut lock = std::mem::replace(&mut self.lock, placeholder);
        let mut dev = CudaDevice {
            be: self,
            req,
            fns: &fns,
            plan: Vec::new(),
            pools: Vec::new(),
            ibufs: Vec::new(),
            obufs: Vec::new(),
            out_sizes: Vec::new(),
            sbufs: Vec::new(),
            args: Vec::new(),
        };
        judge_request(&mut dev, req, progress, &mut reply, &mut lock);
        self.lock = lock;
        reply
    }
}

/// One candidate on one workload's device buffers, for the judge. Host code here is trusted;
/// only the candidate's device code is not: its outputs carry guard zones, the reference is
/// computed only after its runs, and a device fault ends the worker (its context is lost).
struct CudaDevice<'a> {
    be: &'a mut CudaBackend,
    req: &'a EvalRequest,
    fns: &'a [sys::CUfunction],
    plan: Vec<Planned>,
    /// Input pools on the device: each run copies an input from a fresh offset of its pool.
    pools: Vec<DevBuf>,
    ibufs: Vec<DevBuf>,
    /// Outputs with `GUARD` bytes on each side.
    obufs: Vec<DevBuf>,
    out_sizes: Vec<usize>,
    sbufs: Vec<DevBuf>,
    args: Vec<Arg>,
}

/// A stop of the CUDA back-end as the judge sees it; a lost context ends the worker here.
fn judged(s: Stop) -> JStop {
    match s {
        Stop::Fail(f) => JStop {
            failure: f,
            fatal: false,
        },
        Stop::Fault(msg) => die(&msg),
    }
}

impl CudaDevice<'_> {
    fn sync(&self, what: &str) -> Result<(), JStop> {
        self.be.sync().map_err(|e| judged(after_run(e, what)))
    }
}

impl Device for CudaDevice<'_> {
    fn bind(&mut self, index: usize, _dims: &[i64], pools: &[&[u8]], inputs: &[usize], outputs: &[usize]) -> Result<(), JStop> {
        let w = &self.req.workloads[index];
        self.plan = self.be.plan(self.req, self.fns, &w.axes).map_err(judged)?;
        // Free the previous workload's buffers before allocating this one's.
        self.pools.clear();
        self.ibufs.clear();
        self.obufs.clear();
        self.sbufs.clear();
        let stream = self.be.stream;
        for (i, (p, n)) in pools.iter().zip(inputs).enumerate() {
            let name = self.req.task.inputs.get(i).map(|t| t.name.as_str()).unwrap_or("?");
            let b = alloc(p.len(), &format!("the pool of input `{name}`")).map_err(judged)?;
            // SAFETY: the buffer holds exactly these bytes.
            unsafe { cu::memcpy_htod_async(b.ptr, p, stream) }.map_err(|e| judged(after_run(e, "input upload")))?;
            self.pools.push(b);
            self.ibufs.push(alloc(*n, &format!("input `{name}`")).map_err(judged)?);
        }
        for (i, n) in outputs.iter().enumerate() {
            let name = self.req.task.outputs.get(i).map(|t| t.name.as_str()).unwrap_or("?");
            let b = alloc(n + 2 * GUARD, &format!("output `{name}`")).map_err(judged)?;
            // SAFETY: within the buffer.
            unsafe { cu::memset_d8_async(b.ptr, GUARD_BYTE, n + 2 * GUARD, stream) }
                .map_err(|e| judged(after_run(e, "guard fill")))?;
            self.obufs.push(b);
        }
        self.out_sizes = outputs.to_vec();
        let mut env = w.axes.clone();
        env.extend(self.req.candidate.defines.iter().map(|(k, v)| (k.clone(), *v)));
        for s in &self.req.candidate.scratch {
            let bytes = eval_i64(&s.bytes, &env).map_err(|e| {
                judged(fail(
                    FailureClass::Launch,
                    format!("scratch `{}` bytes `{}`: {e}", s.name, s.bytes),
                ))
            })?;
            if bytes < 0 {
                return Err(judged(fail(
                    FailureClass::Launch,
                    format!("scratch `{}`: negative size {bytes}", s.name),
                )));
            }
            let b = alloc(bytes as usize, &format!("scratch `{}`", s.name)).map_err(judged)?;
            // SAFETY: within the buffer.
            unsafe { cu::memset_d8_async(b.ptr, SCRATCH_BYTE, b.bytes.max(1), stream) }
                .map_err(|e| judged(after_run(e, "scratch fill")))?;
            self.sbufs.push(b);
        }
        let mut args: Vec<Arg> = self.ibufs.iter().map(|b| Arg::Ptr(b.ptr)).collect();
        args.extend(self.obufs.iter().map(|b| Arg::Ptr(b.ptr + GUARD as u64)));
        args.extend(self.sbufs.iter().map(|b| Arg::Ptr(b.ptr)));
        args.extend(
            self.req
                .task
                .axes
                .iter()
                .map(|a| Arg::I64(w.axes.get(a).copied().unwrap_or(0))),
        );
        self.args = args;
        Ok(())
    }

    fn stage(&mut self, offsets: &[usize]) -> Result<(), JStop> {
        for ((pool, buf), off) in self.pools.iter().zip(&self.ibufs).zip(offsets) {
            // SAFETY: both ranges lie inside their allocations (the pool is longer by the offset).
            unsafe { cu::memcpy_dtod_async(buf.ptr, pool.ptr + *off as u64, buf.bytes, self.be.stream) }
                .map_err(|e| judged(after_run(e, "staging inputs")))?;
        }
        Ok(())
    }

    fn poison(&mut self, patterns: &[Vec<u8>]) -> Result<(), JStop> {
        let stream = self.be.stream;
        for ((b, n), p) in self.obufs.iter().zip(&self.out_sizes).zip(patterns) {
            let at = b.ptr + GUARD as u64;
            // SAFETY: the payload lies inside the buffer, 4096-aligned.
            let r = unsafe {
                match p.len() {
                    4 => sys::cuMemsetD32Async(at, u32::from_le_bytes([p[0], p[1], p[2], p[3]]), n / 4, stream),
                    2 => sys::cuMemsetD16Async(at, u16::from_le_bytes([p[0], p[1]]), n / 2, stream),
                    1 => sys::cuMemsetD8Async(at, p[0], *n, stream),
                    _ => {
                        let img = p.repeat(n / p.len().max(1));
                        match cu::memcpy_htod_async(at, &img, stream) {
                            Ok(()) => sys::cuStreamSynchronize(stream),
                            Err(e) => e.0,
                        }
                    }
                }
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(judged(after_run(cu::DriverError(r), "poisoning outputs")));
            }
        }
        Ok(())
    }

    fn flush(&mut self) {
        // SAFETY: the flush buffer and stream are ours; a failure shows at the next sync.
        let _ = unsafe { cu::memset_d8_async(self.be.flush.ptr, 0x5A, self.be.flush.bytes, self.be.stream) };
    }

    fn run(&mut self) -> Result<f64, JStop> {
        let (a, b) = (self.be.events[0], self.be.events[1]);
        // SAFETY: events and stream are ours.
        unsafe { cu::event::record(a, self.be.stream) }.map_err(|e| judged(after_run(e, "event record")))?;
        self.be.run(&self.plan, &self.args).map_err(judged)?;
        // SAFETY: as above.
        unsafe { cu::event::record(b, self.be.stream) }.map_err(|e| judged(after_run(e, "event record")))?;
        self.sync("running the kernel")?;
        let ms = self.be.elapsed_ms(a, b).map_err(|e| judged(after_run(e, "event time")))?;
        Ok(ms / 1e3)
    }

    fn read_back(&mut self) -> Result<ReadBack, JStop> {
        // After a synchronisation nothing of the candidate runs any more.
        self.sync("reading back")?;
        let mut outs = Vec::new();
        for (i, (b, n)) in self.obufs.iter().zip(&self.out_sizes).enumerate() {
            let mut back = take_spare(&mut self.be.spare_bytes, n + 2 * GUARD);
            self.be
                .download(&mut back, b.ptr)
                .map_err(|e| judged(after_run(e, "reading outputs")))?;
            let before = back[..GUARD].iter().any(|x| *x != GUARD_BYTE);
            let after = back[GUARD + n..].iter().any(|x| *x != GUARD_BYTE);
            if before || after {
                return Err(JStop::fail(
                    FailureClass::OutOfBounds,
                    format!(
                        "output {i} (`{}`): bytes written {} its buffer",
                        self.req.task.outputs.get(i).map(|t| t.name.as_str()).unwrap_or("?"),
                        if before { "before" } else { "after" }
                    ),
                ));
            }
            back.truncate(GUARD + n);
            back.drain(..GUARD);
            outs.push(back);
        }
        let mut ins = Vec::new();
        for b in &self.ibufs {
            let mut back = take_spare(&mut self.be.spare_bytes, b.bytes);
            self.be
                .download(&mut back, b.ptr)
                .map_err(|e| judged(after_run(e, "reading inputs")))?;
            ins.push(back);
        }
        Ok((outs, ins))
    }

    fn reference(&mut self, task: &Task, w: &WorkloadReq, inputs: &[HostTensor]) -> Result<Vec<Vec<f64>>, JStop> {
        self.be.reference(task, w, inputs).map_err(judged)
    }

    fn recycle(&mut self, bytes: Vec<Vec<u8>>, refs: Vec<Vec<f64>>) {
        keep_spare(&mut self.be.spare_bytes, bytes);
        keep_spare(&mut self.be.spare_f64, refs);
    }

    /// The judge's host work runs on other cores than the launches it could delay, and the
    /// device is idle meanwhile: other workers may measure on it.
    fn host_work_disturbs_timing(&self) -> bool {
        false
    }

    fn peaks(&self) -> Peaks {
        // The measured device-to-device copy over FLOOR_SLACK (a kernel may beat a plain copy
        // a little, e.g. by reading more than it writes); tensor-core and special-function
        // peaks above the H200's.
        Peaks {
            bytes: self.be.copy_bps.max(1e9) / FLOOR_SLACK,
            flops: PEAK_FLOPS,
            transcendentals: PEAK_TRANSCENDENTALS,
        }
    }
}

/// The context is dead: say why on stderr (the supervisor quotes its tail) and exit at once,
/// so that the supervisor reports a crash and starts a fresh worker with a fresh context.
fn die(msg: &str) -> ! {
    use std::io::Write;
    let mut e = std::io::stderr();
    let _ = writeln!(e, "cuda device fault, context lost, worker exits: {msg}");
    let _ = e.flush();
    // SAFETY: ends the process without running CUDA's teardown on a dead context.
    unsafe { libc::_exit(FAULT_EXIT_CODE) }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.bind();
        // SAFETY: everything below was created by this backend and is released once.
        unsafe {
            for (_, m) in std::mem::take(&mut self.modules) {
                let _ = cu::module::unload(m);
            }
            if let Some(m) = self.refmod.take() {
                let _ = cu::module::unload(m);
            }
            for e in self.events.drain(..) {
                let _ = cu::event::destroy(e);
            }
            let _ = cu::stream::destroy(self.stream);
        }
        // The flush buffer is freed by its own Drop before the context goes (fields drop
        // after this body; the primary context stays retained until process exit).
        let _ = (self.ordinal, self.dev);
    }
}

impl Backend for CudaBackend {
    fn backend(&self) -> ksearch_core::Backend {
        ksearch_core::Backend::Cuda
    }

    fn device(&self) -> String {
        format!(
            "{} (sm_{}{}, {} SMs, copy {:.1} TB/s)",
            self.name,
            self.cc.0,
            self.cc.1,
            self.sms,
            self.copy_bps / 1e12
        )
    }

    fn clock(&self) -> Option<String> {
        Some("CUDA events around each call on the worker's stream".into())
    }

    fn eval(&mut self, req: &EvalRequest, progress: &mut dyn FnMut(&str)) -> EvalReply {
        match std::panic::catch_unwind(AssertUnwindSafe(|| self.eval_inner(req, progress))) {
            Ok(r) => r,
            Err(p) => EvalReply::failed(
                req.id,
                FailureClass::Infra,
                format!("cuda back-end panicked: {}", panic_message(p)),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'softmax' for 'sm_90'\n\
ptxas info    : Function properties for softmax\n\
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
ptxas info    : Used 26 registers, used 1 barriers, 4096 bytes smem, 400 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'other' for 'sm_90'\n\
ptxas info    : Function properties for other\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 40 registers, used 0 barriers, 400 bytes cmem[0]\n";

    #[test]
    fn parses_ptxas_report() {
        let r = parse_ptxas(LOG);
        assert_eq!(r.registers, Some(40));
        assert_eq!(r.shared_bytes, Some(4096));
        assert_eq!(r.stack_bytes, Some(8));
        assert_eq!((r.spill_stores, r.spill_loads), (Some(4), Some(4)));
        assert!(r.raw.contains("Used 26 registers"));
        assert_eq!(compiled_entries(LOG), vec!["softmax".to_string(), "other".to_string()]);
    }

    #[test]
    fn arch_selection() {
        let none = BTreeMap::new();
        assert_eq!(candidate_arch((9, 0), "plain", &none), "sm_90");
        assert_eq!(candidate_arch((9, 0), "asm(\"wgmma.mma_async\")", &none), "sm_90a");
        assert_eq!(candidate_arch((8, 0), "wgmma", &none), "sm_80");
        let mut o = BTreeMap::new();
        o.insert("arch".to_string(), serde_json::json!("sm_90a"));
        assert_eq!(candidate_arch((9, 0), "", &o), "sm_90a");
    }

    #[test]
    fn config_sampling_keeps_default_and_respects_max() {
        let k: KernelSpec = serde_json::from_str(
            r#"{"name": "k", "file": "k.cu", "entry": "k", "constraints": ["A * B <= 64"],
                "tunables": [{"name": "A", "values": [1, 2, 4, 8, 16, 32, 64], "default": 4},
                             {"name": "B", "values": [1, 2, 4, 8, 16, 32, 64]}]}"#,
        )
        .unwrap();
        let w: Workload = BTreeMap::new();
        let all = admitted_configs(&k, std::slice::from_ref(&w), 1000);
        assert_eq!(all.len(), 28);
        let few = admitted_configs(&k, std::slice::from_ref(&w), 5);
        assert_eq!(few.len(), 5);
        assert_eq!(few[0], k.default_config());
        assert!(few.iter().all(|c| c["A"] * c["B"] <= 64));
    }

    #[test]
    fn config_sampling_of_a_product_too_large_to_enumerate_keeps_the_defaults_and_every_value() {
        // 2^21 configurations, more than are enumerated; the constraint admits only T0 = 1, the
        // default, which the first half of the product in order never has.
        let tunables: Vec<String> = (0..21)
            .map(|i| format!(r#"{{"name": "T{i}", "values": [0, 1], "default": {}}}"#, (i == 0) as i32))
            .collect();
        let k: KernelSpec = serde_json::from_str(&format!(
            r#"{{"name": "k", "file": "k.cu", "entry": "k", "constraints": ["T0 == 1"], "tunables": [{}]}}"#,
            tunables.join(",")
        ))
        .unwrap();
        let w: Workload = BTreeMap::new();
        let few = admitted_configs(&k, std::slice::from_ref(&w), 20);
        assert_eq!(few.len(), 20);
        assert_eq!(few[0], k.default_config());
        assert!(few.iter().all(|c| c["T0"] == 1 && c.len() == 21));
        let many = admitted_configs(&k, std::slice::from_ref(&w), 2000);
        for i in 1..21 {
            let name = format!("T{i}");
            assert!(
                many.iter().any(|c| c[&name] == 0) && many.iter().any(|c| c[&name] == 1),
                "{name}"
            );
        }
    }
}
