//! The CPU back-end: C++ candidates compiled by the system compiler into shared objects,
//! loaded into the worker, checked against the f64 host reference and timed with a monotonic
//! clock.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use ksearch_core::protocol::{
    CompileInfo, EvalReply, EvalRequest, Failure, FailureClass, Lang, Resources, Timing, WorkloadResult,
};

use crate::Backend;
use crate::common::{check_outputs, host_reference, make_inputs, output_specs};

/// Bytes of guard zone on each side of every output buffer.
const GUARD: usize = 4096;
const GUARD_BYTE: u8 = 0xCD;

type Entry = unsafe extern "C" fn(*mut *mut u8, *const i64);

pub struct CpuBackend {
    cache: PathBuf,
    compiler: String,
    flags: Vec<String>,
    /// Loaded libraries stay mapped for the worker's life (unloading OpenMP code is unsafe).
    libs: BTreeMap<PathBuf, &'static libloading::Library>,
    copy_gbs: f64,
    flush_buf: Vec<u8>,
    threads: usize,
}

pub const CPU_FLAGS: &[&str] = &["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"];

impl CpuBackend {
    pub fn new(cache: PathBuf) -> CpuBackend {
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let mut b = CpuBackend {
            cache,
            compiler,
            flags: CPU_FLAGS.iter().map(|s| s.to_string()).collect(),
            libs: BTreeMap::new(),
            copy_gbs: 0.0,
            flush_buf: vec![0u8; 64 << 20],
            threads,
        };
        b.copy_gbs = b.measure_copy();
        b
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
        for b in self.flush_buf.iter_mut().step_by(64) {
            *b = b.wrapping_add(1);
        }
        std::hint::black_box(&mut self.flush_buf);
    }

    fn compile(&mut self, req: &EvalRequest) -> Result<(PathBuf, CompileInfo), Failure> {
        let c = &req.candidate;
        let mut args: Vec<String> = self.flags.clone();
        args.push("-DKS_CPU=1".into());
        for (k, v) in &req.task.constants {
            args.push(format!("-DKS_{}={v:?}", k.to_uppercase()));
        }
        for (k, v) in &c.defines {
            args.push(format!("-D{k}={v}"));
        }
        let version = compiler_version(&self.compiler);
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(c.source.as_bytes());
        h.update(args.join(" ").as_bytes());
        h.update(version.as_bytes());
        let key: String = h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect();
        let so = self.cache.join(format!("{key}.so"));
        if so.is_file() {
            return Ok((
                so,
                CompileInfo {
                    log: String::new(),
                    cached: true,
                    seconds: 0.0,
                },
            ));
        }
        std::fs::create_dir_all(&self.cache).map_err(|e| infra(format!("cannot create cache {}: {e}", self.cache.display())))?;
        let src = self.cache.join(format!("{key}.cpp"));
        std::fs::write(&src, &c.source).map_err(|e| infra(format!("cannot write {}: {e}", src.display())))?;
        let tmp = self.cache.join(format!("{key}.{}.tmp.so", std::process::id()));
        let t = Instant::now();
        let out = Command::new(&self.compiler)
            .args(&args)
            .arg("-o")
            .arg(&tmp)
            .arg(&src)
            .output()
            .map_err(|e| infra(format!("cannot run compiler `{}`: {e}", self.compiler)))?;
        let seconds = t.elapsed().as_secs_f64();
        let log = String::from_utf8_lossy(&out.stderr).into_owned();
        if !out.status.success() {
            let _ = std::fs::remove_file(&tmp);
            return Err(Failure {
                class: FailureClass::Compile,
                message: first_lines(&log, 30),
            });
        }
        std::fs::rename(&tmp, &so).map_err(|e| infra(format!("cannot move {}: {e}", tmp.display())))?;
        Ok((
            so,
            CompileInfo {
                log,
                cached: false,
                seconds,
            },
        ))
    }

    fn load(&mut self, so: &Path, entries: &[String]) -> Result<Vec<Entry>, Failure> {
        let lib = match self.libs.get(so) {
            Some(l) => *l,
            None => {
                // SAFETY: loading a candidate runs its static initialisers: candidate code is
                // untrusted, which is why it runs here, in a worker the supervisor can kill.
                let l = unsafe { libloading::Library::new(so) }.map_err(|e| Failure {
                    class: FailureClass::Compile,
                    message: format!("cannot load compiled kernel: {e}"),
                })?;
                let l: &'static libloading::Library = Box::leak(Box::new(l));
                self.libs.insert(so.to_path_buf(), l);
                l
            }
        };
        entries
            .iter()
            .map(|e| {
                // SAFETY: the ABI of every entry point is fixed by the task format.
                unsafe { lib.get::<Entry>(e.as_bytes()) }.map(|s| *s).map_err(|_| Failure {
                    class: FailureClass::Compile,
                    message: format!(
                        "entry point `{e}` not found (declare it `extern \"C\" void {e}(void** bufs, const int64_t* dims)`)"
                    ),
                })
            })
            .collect()
    }
}

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

/// Output buffers with guard zones; pointers to their payloads.
struct Outputs {
    bufs: Vec<Vec<u8>>,
    lens: Vec<usize>,
}

impl Outputs {
    fn new(sizes: &[usize]) -> Outputs {
        Outputs {
            bufs: sizes.iter().map(|n| vec![GUARD_BYTE; n + 2 * GUARD]).collect(),
            lens: sizes.to_vec(),
        }
    }
    fn poison(&mut self, dtypes: &[ksearch_core::DType]) {
        for ((b, n), dt) in self.bufs.iter_mut().zip(&self.lens).zip(dtypes) {
            ksearch_core::data::fill_poison(&mut b[GUARD..GUARD + n], *dt);
        }
    }
    fn ptrs(&mut self) -> Vec<*mut u8> {
        // SAFETY: GUARD is within every buffer.
        self.bufs.iter_mut().map(|b| unsafe { b.as_mut_ptr().add(GUARD) }).collect()
    }
    fn guards_intact(&self) -> Result<(), String> {
        for (i, (b, n)) in self.bufs.iter().zip(&self.lens).enumerate() {
            let before = b[..GUARD].iter().any(|x| *x != GUARD_BYTE);
            let after = b[GUARD + n..].iter().any(|x| *x != GUARD_BYTE);
            if before || after {
                return Err(format!(
                    "output {i}: bytes written {} its buffer",
                    if before { "before" } else { "after" }
                ));
            }
        }
        Ok(())
    }
    fn payloads(&self) -> Vec<Vec<u8>> {
        self.bufs
            .iter()
            .zip(&self.lens)
            .map(|(b, n)| b[GUARD..GUARD + n].to_vec())
            .collect()
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
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

    fn eval(&mut self, req: &EvalRequest, progress: &mut dyn FnMut(&str)) -> EvalReply {
        let started = Instant::now();
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
        let entries: Vec<String> = req.candidate.launches.iter().map(|l| l.entry.clone()).collect();
        let fns = match self.load(&so, &entries) {
            Ok(f) => f,
            Err(f) => {
                reply.failure = Some(f);
                return reply;
            }
        };
        progress("compiled");
        let mut kernel_s = 0.0;
        let mut other_s = 0.0;
        let n = req.workloads.len();
        for (wi, w) in req.workloads.iter().enumerate() {
            let t_other = Instant::now();
            let mut res = WorkloadResult {
                label: w.label.clone(),
                axes: w.axes.clone(),
                seed: w.seed,
                ..WorkloadResult::default()
            };
            let dims: Vec<i64> = req.task.axes.iter().map(|a| w.axes.get(a).copied().unwrap_or(0)).collect();
            let prepared = make_inputs(&req.task, &req.backend, w)
                .and_then(|i| output_specs(&req.task, &req.backend, w).map(|o| (i, o)))
                .and_then(|(i, o)| host_reference(&req.task, w, &i).map(|r| (i, o, r)));
            let (mut inputs, outs, refs) = match prepared {
                Ok(x) => x,
                Err(e) => {
                    res.failure = Some(infra(e));
                    reply.workloads.push(res);
                    continue;
                }
            };
            res.bytes = req.task.min_bytes(&req.backend, &w.axes).unwrap_or(0.0);
            res.flops = req.task.flops(&w.axes);
            let flops_peak = self.threads as f64 * 4.0e9 * 64.0;
            let floor_s = (res.bytes / (4.0 * self.copy_gbs.max(1.0) * 1e9)).max(res.flops / flops_peak);
            res.floor_us = Some(floor_s * 1e6);
            let sizes: Vec<usize> = outs.iter().map(|(_, n, dt)| n * dt.size()).collect();
            let dtypes: Vec<ksearch_core::DType> = outs.iter().map(|(_, _, d)| *d).collect();
            let mut o = Outputs::new(&sizes);
            o.poison(&dtypes);
            let mut ptrs: Vec<*mut u8> = inputs.iter_mut().map(|t| t.bytes.as_mut_ptr()).collect();
            ptrs.extend(o.ptrs());
            other_s += t_other.elapsed().as_secs_f64();
            let run = |ptrs: &mut Vec<*mut u8>| {
                for f in &fns {
                    // SAFETY: untrusted candidate code, run in this worker by design.
                    unsafe { f(ptrs.as_mut_ptr(), dims.as_ptr()) };
                }
            };
            let t = Instant::now();
            run(&mut ptrs);
            kernel_s += t.elapsed().as_secs_f64();
            let t_other = Instant::now();
            if let Err(e) = o.guards_intact() {
                res.failure = Some(Failure {
                    class: FailureClass::OutOfBounds,
                    message: e,
                });
                reply.workloads.push(res);
                continue;
            }
            let (check, failure) = check_outputs(&req.task, &req.backend, &o.payloads(), &refs);
            res.check = check;
            res.failure = failure;
            other_s += t_other.elapsed().as_secs_f64();
            if res.failure.is_none() && !req.check_only {
                let tm = &req.timing;
                for _ in 0..tm.warmup {
                    run(&mut ptrs);
                }
                let mut samples = Vec::new();
                let t_all = Instant::now();
                while (samples.len() as u32) < tm.max_reps {
                    if tm.flush {
                        self.flush();
                    }
                    let t = Instant::now();
                    run(&mut ptrs);
                    samples.push(t.elapsed().as_secs_f64() * 1e6);
                    if samples.len() as u32 >= tm.min_reps && t_all.elapsed().as_secs_f64() * 1e3 >= tm.target_ms {
                        break;
                    }
                }
                kernel_s += samples.iter().sum::<f64>() / 1e6;
                // The timed runs must still compute the right thing (no state carried over).
                o.poison(&dtypes);
                run(&mut ptrs);
                let (c2, f2) = check_outputs(&req.task, &req.backend, &o.payloads(), &refs);
                if let Some(mut f) = f2 {
                    f.message = format!("after timing: {}", f.message);
                    res.failure = Some(f);
                    res.check = c2;
                }
                let timing = Timing::from_samples(samples);
                if timing.median_us < floor_s * 1e6 {
                    res.failure = Some(Failure {
                        class: FailureClass::BelowFloor,
                        message: format!(
                            "median {:.2} us is below the physical floor {:.2} us",
                            timing.median_us,
                            floor_s * 1e6
                        ),
                    });
                }
                res.timing = Some(timing);
            }
            reply.workloads.push(res);
            progress(&format!("workload {}/{n}", wi + 1));
        }
        reply.kernel_s = kernel_s;
        reply.overhead_s = other_s;
        let _ = started;
        reply.resources = Resources::default();
        reply
    }
}
