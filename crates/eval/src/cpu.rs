//! The CPU back-end: C++ candidates compiled by the system compiler into shared objects (the
//! trusted side), run in a sandboxed runner process (`sandbox.rs`) on buffers this worker
//! fills and reads, and judged by the shared skeleton (`judge.rs`): f64 host reference, every
//! element checked, time measured here around each call.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use ksearch_core::protocol::{CompileInfo, EvalReply, EvalRequest, Failure, FailureClass, Lang, Resources};

use crate::Backend;
use crate::common::{output_specs, signal_name};
use crate::judge::{Device, Peaks, ReadBack, Stop, judge_request};
use crate::sandbox::{self, Death, Runner, SLACK_BYTE};

pub struct CpuBackend {
    cache: PathBuf,
    compiler: String,
    flags: Vec<String>,
    copy_gbs: f64,
    flush_buf: FlushBuf,
    threads: usize,
    /// Data memory a runner may allocate.
    mem_limit: u64,
    /// What the runner's sandbox achieved on this machine (probed at start).
    isolation: String,
    /// The measurement lock of the machine's cores, shared with the other CPU workers.
    lock: crate::common::DeviceLock,
}

pub const CPU_FLAGS: &[&str] = &["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"];

impl CpuBackend {
    pub fn new(cache: PathBuf) -> CpuBackend {
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        // A reference the task brings is compiled into the same verified cache.
        crate::task_ref::set_cache_dir(cache.clone());
        let lock = crate::common::DeviceLock::cpu(&cache);
        let mut b = CpuBackend {
            cache,
            compiler,
            flags: CPU_FLAGS.iter().map(|s| s.to_string()).collect(),
            copy_gbs: 0.0,
            flush_buf: FlushBuf::new(64 << 20),
            threads,
            mem_limit: 8 << 30,
            isolation: String::new(),
            lock,
        };
        // Measured while no other worker measures (a lock that cannot be taken is reported by
        // the first evaluation).
        let hold = b.lock.acquire().ok();
        b.copy_gbs = b.measure_copy();
        if let Some(h) = hold {
            b.lock.release(h);
        }
        b.isolation = match runner_exe() {
            Ok(exe) => sandbox::probe(&exe),
            Err(_) => "unknown".into(),
        };
        b
    }

    /// Limit the data memory of each runner.
    pub fn set_mem_limit(&mut self, bytes: u64) {
        self.mem_limit = bytes;
    }

    /// Best of a few 32 MiB copies, in GB/s (read + write bytes).
    fn measure_copy(&mut self) -> f64 {
        let n = 32 << 20;
        let src = vec![1u8; n];
        let mut dst = vec![0u8; n];
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut dst);
            best = best.min(t.elapsed().as_secs_f64());
        }
        2.0 * n as f64 / best / 1e9
    }

    fn flush(&mut self) {
        for b in self.flush_buf.bytes().iter_mut().step_by(64) {
            *b = b.wrapping_add(1);
        }
        std::hint::black_box(self.flush_buf.bytes());
    }

    /// Compile (or take from the cache) and return the shared object's bytes.
    fn compile(&mut self, req: &EvalRequest) -> Result<(Vec<u8>, CompileInfo), Failure> {
        let c = &req.candidate;
        let mut args: Vec<String> = self.flags.clone();
        args.push("-DKS_CPU=1".into());
        for (k, v) in &req.task.constants {
            args.push(format!("-DKS_{}={v:?}", k.to_uppercase()));
        }
        for (k, v) in &c.defines {
            args.push(format!("-D{k}={v}"));
        }
        compile_cached(&self.cache, &self.compiler, &args, &c.source, "kernel.cpp")
    }
}

/// Compile `source` with `compiler` and `args` into a shared object, or take it from `cache`;
/// its bytes. Cache entries are addressed by the hash of source, flags, defines and compiler
/// identity, and carry the hash of the artefact, checked at every load: an entry changed by
/// anyone but this side is recompiled, never loaded. `shown_as` names the source in the log.
pub(crate) fn compile_cached(
    cache: &Path,
    compiler: &str,
    args: &[String],
    source: &str,
    shown_as: &str,
) -> Result<(Vec<u8>, CompileInfo), Failure> {
    let version = compiler_version(compiler);
    let key = sha256_hex(&[source.as_bytes(), args.join(" ").as_bytes(), version.as_bytes()], 16);
    let so = cache.join(format!("{key}.so"));
    let sum = cache.join(format!("{key}.so.sha256"));
    let mut note = String::new();
    if let (Ok(bytes), Ok(want)) = (std::fs::read(&so), std::fs::read_to_string(&sum)) {
        if sha256_hex(&[&bytes], 32) == want.trim() {
            return Ok((
                bytes,
                CompileInfo {
                    log: String::new(),
                    cached: true,
                    seconds: 0.0,
                },
            ));
        }
        note = format!("cache entry {key}.so failed verification: recompiled\n");
        let _ = std::fs::remove_file(&so);
        let _ = std::fs::remove_file(&sum);
    }
    std::fs::create_dir_all(cache).map_err(|e| infra(format!("cannot create cache {}: {e}", cache.display())))?;
    let src = cache.join(format!("{key}.{}.cpp", std::process::id()));
    std::fs::write(&src, source).map_err(|e| infra(format!("cannot write {}: {e}", src.display())))?;
    let tmp = cache.join(format!("{key}.{}.tmp.so", std::process::id()));
    let t = Instant::now();
    // The compiler reads candidate source: it runs in the cache folder (not the user's), with
    // bounded address space and output size, so a source that makes it read or write without
    // end (an `#include` of /dev/zero) is stopped by the kernel, not by the machine's memory.
    let (tmp_abs, src_abs) = (
        std::path::absolute(&tmp).unwrap_or(tmp.clone()),
        std::path::absolute(&src).unwrap_or(src.clone()),
    );
    let mut cmd = Command::new(compiler);
    cmd.args(args).arg("-o").arg(&tmp_abs).arg(&src_abs).current_dir(cache);
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: only async-signal-safe calls (setrlimit) between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                for (res, v) in [
                    (libc::RLIMIT_AS, COMPILER_MEMORY),
                    (libc::RLIMIT_FSIZE, COMPILER_FILE_BYTES),
                    (libc::RLIMIT_CORE, 0),
                ] {
                    let lim = libc::rlimit {
                        rlim_cur: v,
                        rlim_max: v,
                    };
                    libc::setrlimit(res, &lim);
                }
                Ok(())
            });
        }
    }
    let out = cmd
        .output()
        .map_err(|e| infra(format!("cannot run compiler `{compiler}`: {e}")));
    let _ = std::fs::remove_file(&src);
    let out = out?;
    let seconds = t.elapsed().as_secs_f64();
    let log = format!(
        "{note}{}",
        String::from_utf8_lossy(&out.stderr).replace(&format!("{}", src.display()), shown_as)
    );
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        // The compiler could not write its output: the cache's disk is full, not the candidate
        // wrong (the log alone could be the candidate's `#error`; the free space decides).
        if log.contains("No space left on device") && free_bytes(cache).is_some_and(|b| b < FULL_DISK_BYTES) {
            return Err(infra(format!(
                "the compile cache's disk is full ({}): {}",
                cache.display(),
                first_lines(&log, 3)
            )));
        }
        let mut message = first_lines(&log, 30);
        if message.trim().is_empty() {
            #[cfg(unix)]
            {
                use std::os::unix::process::ExitStatusExt;
                message = match out.status.signal() {
                    Some(sig) => format!(
                        "the compiler was killed by signal {sig} (it may use {} GiB of memory and write {} GiB)",
                        COMPILER_MEMORY >> 30,
                        COMPILER_FILE_BYTES >> 30
                    ),
                    None => format!("the compiler failed ({}) without a message", out.status),
                };
            }
        }
        return Err(Failure {
            class: FailureClass::Compile,
            message,
        });
    }
    let bytes = std::fs::read(&tmp).map_err(|e| infra(format!("cannot read {}: {e}", tmp.display())))?;
    let hash = sha256_hex(&[&bytes], 32);
    let sum_tmp = cache.join(format!("{key}.{}.tmp.sha256", std::process::id()));
    std::fs::write(&sum_tmp, &hash)
        .and_then(|_| std::fs::rename(&tmp, &so))
        .and_then(|_| std::fs::rename(&sum_tmp, &sum))
        .map_err(|e| infra(format!("cannot store {} in the cache: {e}", so.display())))?;
    Ok((
        bytes,
        CompileInfo {
            log,
            cached: false,
            seconds,
        },
    ))
}

/// The executable to start runners from: this very binary, even if the file was replaced since
/// it started (a rebuild during a search), through `/proc/self/exe` on Linux.
fn runner_exe() -> std::io::Result<PathBuf> {
    if cfg!(target_os = "linux") {
        Ok(PathBuf::from("/proc/self/exe"))
    } else {
        std::env::current_exe()
    }
}

/// The buffer written to evict caches. Kept out of forked children (`MADV_DONTFORK`): every
/// runner is started with a fork, which would otherwise write-protect these 64 MiB and make
/// the next flush take a page fault per page (about 25 ms per evaluation).
struct FlushBuf {
    ptr: *mut u8,
    len: usize,
}

impl FlushBuf {
    fn new(len: usize) -> FlushBuf {
        // SAFETY: a fresh private anonymous mapping, owned by this value until Drop.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                return FlushBuf {
                    ptr: std::ptr::null_mut(),
                    len: 0,
                };
            }
            #[cfg(target_os = "linux")]
            libc::madvise(p, len, libc::MADV_DONTFORK);
            FlushBuf { ptr: p as *mut u8, len }
        }
    }
    fn bytes(&mut self) -> &mut [u8] {
        if self.ptr.is_null() {
            return &mut [];
        }
        // SAFETY: the mapping is `len` bytes and lives as long as self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for FlushBuf {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: the mapping made in `new`.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        }
    }
}

fn sha256_hex(parts: &[&[u8]], bytes: usize) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    h.finalize().iter().take(bytes).map(|b| format!("{b:02x}")).collect()
}

/// Below this much free space, a compiler's "No space left on device" is the disk's fault.
const FULL_DISK_BYTES: u64 = 64 << 20;
/// The compiler's address space (a heavy template instantiation needs well under this).
const COMPILER_MEMORY: u64 = 4 << 30;
/// The largest file the compiler may write.
const COMPILER_FILE_BYTES: u64 = 1 << 30;

/// Bytes free for unprivileged writers on the filesystem holding `path`.
fn free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes the struct it is given; `c` is NUL-terminated.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return None;
        }
        Some(st.f_bavail as u64 * st.f_frsize as u64)
    }
}

/// A failure of the machine, not the candidate's.
fn infra(message: String) -> Failure {
    Failure {
        class: FailureClass::Infra,
        message,
    }
}

fn first_lines(s: &str, n: usize) -> String {
    let v: Vec<&str> = s.lines().take(n).collect();
    v.join("\n")
}

fn compiler_version(cxx: &str) -> String {
    Command::new(cxx)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().next().unwrap_or("").to_string())
        .unwrap_or_default()
}

impl Backend for CpuBackend {
    fn backend(&self) -> ksearch_core::Backend {
        ksearch_core::Backend::Cpu
    }

    fn device(&self) -> String {
        let model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
            })
            .unwrap_or_else(|| "cpu".into());
        format!("{model} ({} threads, copy {:.1} GB/s)", self.threads, self.copy_gbs)
    }

    fn isolation(&self) -> Option<String> {
        Some(self.isolation.clone())
    }

    fn clock(&self) -> Option<String> {
        Some("the host's monotonic clock around each call".into())
    }

    fn eval(&mut self, req: &EvalRequest, progress: &mut dyn FnMut(&str)) -> EvalReply {
        let mut reply = EvalReply {
            id: req.id,
            ..EvalReply::default()
        };
        if req.candidate.lang != Lang::Cpp {
            reply.failure = Some(Failure {
                class: FailureClass::Check,
                message: format!("the cpu back-end runs C++ candidates, not {:?}", req.candidate.lang),
            });
            return reply;
        }
        let (so, info) = match self.compile(req) {
            Ok(x) => x,
            Err(f) => {
                reply.failure = Some(f);
                return reply;
            }
        };
        reply.compile = info;
        let t = Instant::now();
        let mut dev = match CpuDevice::start(self, req, &so) {
            Ok(d) => d,
            Err(f) => {
                reply.failure = Some(f);
                return reply;
            }
        };
        reply.overhead_s += t.elapsed().as_secs_f64();
        progress("compiled");
        let mut lock = std::mem::replace(&mut dev.backend.lock, crate::common::DeviceLock::cpu(Path::new("")));
        judge_request(&mut dev, req, progress, &mut reply, &mut lock);
        dev.backend.lock = lock;
        reply.resources = Resources::default();
        reply
    }
}

/// One candidate's runner and the buffers of the workload being judged.
struct CpuDevice<'a> {
    backend: &'a mut CpuBackend,
    runner: Runner,
    /// Slots of each workload: inputs then outputs.
    slots: Vec<Vec<usize>>,
    /// The bound workload: (slot, payload bytes) for inputs then outputs, and its input pools.
    bufs: Vec<(usize, usize)>,
    n_in: usize,
    dims: Vec<i64>,
    pools: Vec<Vec<u8>>,
    /// Each input's element type on this back-end.
    dtypes: Vec<ksearch_core::task::DType>,
}

impl<'a> CpuDevice<'a> {
    fn start(backend: &'a mut CpuBackend, req: &EvalRequest, so: &[u8]) -> Result<CpuDevice<'a>, Failure> {
        let mut sizes = Vec::new();
        let mut slots = Vec::new();
        for w in &req.workloads {
            let mut mine = Vec::new();
            let ins = make_input_sizes(req, w).map_err(infra)?;
            let outs = output_specs(&req.task, req.backend, w).map_err(infra)?;
            for b in ins.into_iter().chain(outs.iter().map(|(_, n, dt)| n * dt.size())) {
                mine.push(sizes.len());
                sizes.push(b);
            }
            slots.push(mine);
        }
        let entries: Vec<String> = req.candidate.launches.iter().map(|l| l.entry.clone()).collect();
        let exe = runner_exe().map_err(|e| infra(format!("cannot find the runner executable: {e}")))?;
        let runner = Runner::start(&exe, &sizes, so, &entries, backend.mem_limit).map_err(|e| {
            if let Some(m) = e.strip_prefix("LOAD:") {
                Failure {
                    class: FailureClass::Compile,
                    message: m.to_string(),
                }
            } else if let Some(m) = e.strip_prefix("INFRA:") {
                // Nothing of the candidate ran yet: not its failure.
                infra(m.to_string())
            } else {
                Failure {
                    class: FailureClass::Crash,
                    message: e,
                }
            }
        })?;
        Ok(CpuDevice {
            backend,
            runner,
            slots,
            bufs: Vec::new(),
            n_in: 0,
            dims: Vec::new(),
            pools: Vec::new(),
            dtypes: req.task.inputs.iter().map(|t| req.task.dtype_on(req.backend, t)).collect(),
        })
    }

    /// What the runner's death means.
    fn death(&mut self, d: Death, doing: &str) -> Stop {
        let tail = self.runner.stderr_tail();
        let with_tail = |m: String| if tail.is_empty() { m } else { format!("{m}; stderr: {tail}") };
        match d {
            Death::Signal { sig, fault } => {
                if let Some(addr) = fault
                    && let Some((slot, past)) = self.runner.locate_fault(addr)
                    && let Some(pos) = self.bufs.iter().position(|(s, _)| *s == slot)
                {
                    let (kind, i) = if pos < self.n_in {
                        ("input", pos)
                    } else {
                        ("output", pos - self.n_in)
                    };
                    let msg = if past >= 0 {
                        format!("accessed {kind} {i} {} bytes past its end ({doing})", past + 1)
                    } else {
                        format!("accessed {kind} {i} {} bytes before its start ({doing})", -past)
                    };
                    return Stop::fatal(FailureClass::OutOfBounds, msg);
                }
                if fault.is_some_and(|a| self.runner.locate_fault(a).is_some()) {
                    return Stop::fatal(
                        FailureClass::OutOfBounds,
                        format!("accessed a guard page next to a buffer of another workload ({doing})"),
                    );
                }
                let lower = tail.to_lowercase();
                let near_limit = self.runner.peak_rss as f64 > 0.8 * self.backend.mem_limit as f64;
                if near_limit
                    || lower.contains("bad_alloc")
                    || lower.contains("out of memory")
                    || lower.contains("cannot allocate")
                {
                    return Stop::fatal(
                        FailureClass::OutOfMemory,
                        with_tail(format!(
                            "the kernel ran out of memory (limit {} MiB) while {doing}",
                            self.backend.mem_limit >> 20
                        )),
                    );
                }
                Stop::fatal(
                    FailureClass::Crash,
                    with_tail(format!("kernel process killed by {} ({sig}) while {doing}", signal_name(sig))),
                )
            }
            Death::Exit(code) => Stop::fatal(
                FailureClass::Crash,
                with_tail(format!("kernel process exited with code {code} while {doing}")),
            ),
            // Outputs read after a forged "done" cannot be believed, whatever they hold.
            Death::Forged(why) => Stop::fatal(FailureClass::Wrong, format!("{why} while {doing}")),
        }
    }
}

fn make_input_sizes(req: &EvalRequest, w: &ksearch_core::protocol::WorkloadReq) -> Result<Vec<usize>, String> {
    req.task
        .inputs
        .iter()
        .map(|t| {
            let n: usize = ksearch_core::task::shape_of(t, &w.axes)?.iter().product();
            Ok(n * req.task.dtype_on(req.backend, t).size())
        })
        .collect()
}

impl Device for CpuDevice<'_> {
    fn bind(&mut self, index: usize, dims: &[i64], pools: &[&[u8]], inputs: &[usize], outputs: &[usize]) -> Result<(), Stop> {
        let slots = &self.slots[index];
        self.bufs = slots.iter().copied().zip(inputs.iter().chain(outputs).copied()).collect();
        self.n_in = inputs.len();
        self.dims = dims.to_vec();
        self.pools = pools.iter().map(|p| p.to_vec()).collect();
        for &(slot, _) in &self.bufs {
            self.runner.slot(slot).fill(SLACK_BYTE);
        }
        Ok(())
    }

    fn stage(&mut self, offsets: &[usize]) -> Result<(), Stop> {
        for (i, off) in offsets.iter().enumerate() {
            let (slot, size) = self.bufs[i];
            let src = &self.pools[i][*off..off + size];
            self.runner.payload(slot, size).copy_from_slice(src);
        }
        Ok(())
    }

    fn fresh_values(&self) -> bool {
        true
    }

    fn stage_fresh(&mut self, offsets: &[usize], fresh: &[ksearch_core::data::Fresh]) -> Result<(), Stop> {
        for (i, off) in offsets.iter().enumerate() {
            let (slot, size) = self.bufs[i];
            let src = &self.pools[i][*off..off + size];
            let f = fresh.get(i).copied().unwrap_or(ksearch_core::data::Fresh::NONE);
            f.apply(src, self.runner.payload(slot, size), self.dtypes[i]);
        }
        Ok(())
    }

    fn poison(&mut self, patterns: &[Vec<u8>]) -> Result<(), Stop> {
        for (j, p) in patterns.iter().enumerate() {
            let (slot, size) = self.bufs[self.n_in + j];
            ksearch_core::data::fill_pattern(self.runner.payload(slot, size), p);
        }
        Ok(())
    }

    fn flush(&mut self) {
        self.backend.flush();
    }

    fn run(&mut self) -> Result<f64, Stop> {
        let bufs = self.bufs.clone();
        let dims = self.dims.clone();
        self.runner.run(&bufs, &dims).map_err(|d| self.death(d, "running"))
    }

    fn read_back(&mut self) -> Result<ReadBack, Stop> {
        let mut back = ReadBack::default();
        self.read_back_into(&mut back)?;
        Ok(back)
    }

    /// The runner stays stopped until the next call; the copies go into the judge's buffers
    /// (their capacity reused), so every read-back costs the same.
    fn read_back_into(&mut self, into: &mut ReadBack) -> Result<(), Stop> {
        let bufs = self.bufs.clone();
        let n_in = self.n_in;
        let (outs, ins) = into;
        let got = self.runner.stopped(|r| {
            let mut slack = None;
            for (k, &(slot, size)) in bufs.iter().enumerate() {
                let start = sandbox::payload_offset(size);
                let s = r.slot(slot);
                let before = s[..start].iter().any(|b| *b != SLACK_BYTE);
                let after = s[start + size..].iter().any(|b| *b != SLACK_BYTE);
                if before || after {
                    slack = Some((k, before));
                    break;
                }
            }
            for (into, part) in [(&mut *ins, &bufs[..n_in]), (&mut *outs, &bufs[n_in..])] {
                into.resize_with(part.len(), Vec::new);
                for (v, &(slot, size)) in into.iter_mut().zip(part) {
                    v.clear();
                    v.extend_from_slice(r.payload(slot, size));
                }
            }
            slack
        });
        match got {
            Ok(Some((k, before))) => {
                let (kind, i) = if k < n_in { ("input", k) } else { ("output", k - n_in) };
                Err(Stop::fail(
                    FailureClass::OutOfBounds,
                    format!(
                        "wrote {} {kind} {i}",
                        if before { "before the start of" } else { "past the end of" }
                    ),
                ))
            }
            Ok(None) => Ok(()),
            Err(d) => Err(self.death(d, "stopping to read outputs")),
        }
    }

    fn uniform_read_back(&self) -> bool {
        true
    }

    fn peaks(&self) -> Peaks {
        // Bandwidth: four times the measured DRAM copy, since small workloads partly stay in
        // caches and the copy is measured on a machine that may be busy. Flops: 64 per cycle
        // per thread at 4 GHz (two AVX-512 FMA pipes), above any x86 core.
        Peaks {
            bytes: 4.0 * self.backend.copy_gbs.max(1.0) * 1e9,
            flops: self.backend.threads as f64 * 4.0e9 * 64.0,
            transcendentals: f64::INFINITY,
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A stand-in compiler (a shell script) in a fresh folder; `body` runs for a compile.
    fn fake_compiler(tag: &str, body: &str) -> std::path::PathBuf {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!("ksearch-cc-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cc = dir.join("cc.sh");
        let script = format!("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake-cc 1; exit 0; fi\n{body}\n");
        std::fs::write(&cc, script).unwrap();
        std::fs::set_permissions(&cc, std::fs::Permissions::from_mode(0o755)).unwrap();
        dir
    }

    /// The value of one row of /proc/self/limits as the compiler saw it (its soft limit).
    fn limit<'a>(log: &'a str, row: &str) -> Option<&'a str> {
        log.lines()
            .find(|l| l.starts_with(row))
            .and_then(|l| l[row.len()..].split_whitespace().next())
    }

    #[test]
    fn the_compiler_runs_under_address_space_file_size_and_core_limits() {
        let dir = fake_compiler("limits", "cat /proc/self/limits >&2\nexit 1");
        let cc = dir.join("cc.sh");
        let e = compile_cached(&dir.join("cache"), cc.to_str().unwrap(), &[], "int x;\n", "kernel.cpp").unwrap_err();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(e.class, FailureClass::Compile, "{}", e.message);
        let (mem, file) = (COMPILER_MEMORY.to_string(), COMPILER_FILE_BYTES.to_string());
        assert_eq!(limit(&e.message, "Max address space"), Some(mem.as_str()), "{}", e.message);
        assert_eq!(limit(&e.message, "Max file size"), Some(file.as_str()), "{}", e.message);
        assert_eq!(limit(&e.message, "Max core file size"), Some("0"), "{}", e.message);
    }

    #[test]
    fn a_compiler_killed_by_its_limits_is_a_compile_failure_that_names_them() {
        // What the kernel does to a compiler writing past its file-size limit (SIGXFSZ), without
        // writing a GiB: a one-line compile failure naming the signal and the limits.
        let dir = fake_compiler("xfsz", "kill -XFSZ $$");
        let cc = dir.join("cc.sh");
        let e = compile_cached(&dir.join("cache"), cc.to_str().unwrap(), &[], "int x;\n", "kernel.cpp").unwrap_err();
        let leftovers: Vec<_> = std::fs::read_dir(dir.join("cache"))
            .map(|d| d.flatten().map(|x| x.file_name()).collect())
            .unwrap_or_default();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(e.class, FailureClass::Compile, "{}", e.message);
        assert_eq!(
            e.message,
            format!(
                "the compiler was killed by signal {} (it may use 4 GiB of memory and write 1 GiB)",
                libc::SIGXFSZ
            )
        );
        // Nothing of the failed compile stays in the cache (its source copy, a partial output).
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }
}
